"""Pass manager: registry and plugins, pipelines, config, invariants, --verify-each, idempotency."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from mtkc.errors import InputError, MismatchError, MtkcError, PassError
from mtkc.ir import execute
from mtkc.ir.model import load
from mtkc.manager.pass_manager import Pipeline, resolve_pipeline, run_pipeline
from mtkc.pipeline.registry import builtin_passes, load_registry
from mtkc.options import Layer, Options, build
from mtkc.passes import pipelines
from mtkc.passes.pipelines import default_pipeline
from mtkc.pipeline.config import load_config
from mtkc.rewrite.pass_api import Context, Pass, PassResult
from mtkc.target.capability import load_table

PLUGINS = Path(__file__).parent / "plugins"
SDK = "8.0"


def plugin(name: str) -> str:
    return str(PLUGINS / f"{name}.py")


@pytest.fixture
def small(tmp_path) -> Path:
    """x[N,4] -> MatMul(W) -> Identity -> Add(b) -> Relu -> y; N symbolic."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    b = onnx.numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Identity", ["h"], ["h2"], name="id"),
        helper.make_node("Add", ["h2", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w, b],
    )
    path = tmp_path / "small" / "model.onnx"
    path.parent.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def table():
    return load_table(SDK)


def run(path: Path, table, passes: list[str], plugins=(), verify_each=False, options=None):
    model = load(path)
    ctx = Context(table, dict(options or {}), model.root, model.values)
    pipeline = resolve_pipeline(load_registry(list(plugins)), ctx, passes)
    return model, run_pipeline(model.graph, pipeline, ctx, verify_each=verify_each)


# --- registry and plugins -------------------------------------------------------------------


def test_builtins_are_discovered_in_module_order():
    builtins = builtin_passes()
    assert {"fold", "rmsnorm", "rope", "swiglu"} <= set(builtins)
    assert all(cls.origin == "built-in" for cls in builtins.values())
    modules = [".".join(cls.__module__.split(".")[:3]) for cls in builtins.values()]  # a subpackage counts once
    assert modules == sorted(modules)


def test_plugin_file_is_loaded_enabled_and_placed_after_its_anchor(table):
    registry = load_registry([plugin("strip_identity")])
    cls = registry.get("strip-identity")
    assert cls.origin == f"plugin {plugin('strip_identity')}"
    assert registry.enabled == ["strip-identity"]
    ctx = Context(table, {})
    names = resolve_pipeline(registry, ctx).names
    assert names[names.index("fold") + 1] == "strip-identity"
    assert "strip-identity" not in resolve_pipeline(load_registry(), ctx).names


def test_plugin_pass_runs_and_keeps_numbers(small, table):
    model, records = run(small, table, ["strip-identity"], [plugin("strip_identity")], verify_each=True)
    assert [(r.name, r.rewrites, r.nodes_before, r.nodes_after) for r in records] == [("strip-identity", 1, 4, 3)]
    assert [n.op for n in model.graph.nodes] == ["MatMul", "Add", "Relu"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("import_error", "import_error.py failed to import: ModuleNotFoundError: No module named 'mtkc_no_such_module_for_tests'"),
        ("bad_name", "bad_name.py (mtkc_plugin_bad_name.BadName): pass name 'Bad_Name' is not kebab-case"),
        ("duplicate", "pass name 'fold' is registered twice: by built-in (mtkc.passes.fold."),
    ],
)
def test_broken_plugin_is_a_pass_error_naming_it(name, message):
    with pytest.raises(PassError) as err:
        load_registry([plugin(name)])
    assert message in str(err.value)
    if name == "duplicate":
        assert f"and by plugin {plugin('duplicate')}" in str(err.value)


def test_plugin_that_raises_is_named(small, table):
    with pytest.raises(PassError, match=r"pass 'crash-in-run' \(plugin .*raises_in_run.py .*\) raised in run: RuntimeError: boom from the plugin"):
        run(small, table, ["crash-in-run"], [plugin("raises_in_run")])


def test_missing_plugin_file_and_module():
    with pytest.raises(PassError, match="plugin nope/missing.py: no such file"):
        load_registry(["nope/missing.py"])
    with pytest.raises(PassError, match="plugin mtkc_absent_module failed to import"):
        load_registry(["mtkc_absent_module"])


# --- pipelines ------------------------------------------------------------------------------


def test_unknown_pass_names_list_the_available_ones(table):
    registry = load_registry()
    with pytest.raises(InputError, match=r"unknown pass 'nope'; available: .*fold.*rmsnorm"):
        resolve_pipeline(registry, Context(table, {}), ["fold", "nope"])
    with pytest.raises(InputError, match="unknown pass 'typo'"):
        resolve_pipeline(registry, Context(table, {}), None, ["typo"])


def test_default_pipeline_skips_unregistered_and_skip_pass(table):
    registry = load_registry()
    ctx = Context(table, {"seq_len": 8})
    full = resolve_pipeline(registry, ctx)
    expected = [n for n in default_pipeline(SDK) if n in registry.passes and registry.get(n)().applies(ctx)]
    assert full.names == expected and "fold" in expected
    less = resolve_pipeline(registry, ctx, None, ["fold"])
    assert less.names == [n for n in expected if n != "fold"]
    assert ("fold", "--skip-pass") in less.skipped


def test_exact_pass_list_keeps_order(table):
    names = resolve_pipeline(load_registry(), Context(table, {}), ["swiglu", "fold"]).names
    assert names == ["swiglu", "fold"]


def test_an_unregistered_default_name_is_an_input_error(table, monkeypatch):
    monkeypatch.setitem(pipelines.BY_SDK, SDK, ["fold", "not-landed-yet"])
    with pytest.raises(InputError, match=r"default pipeline: pass 'not-landed-yet' is not registered"):
        resolve_pipeline(load_registry(), Context(table, {}))


def test_declared_order_is_checked_when_the_pipeline_is_resolved(table):
    """contrib-ops declares before = ("fold",); a requires on an absent or later pass is refused."""
    registry = load_registry()
    with pytest.raises(InputError, match=r"pass 'contrib-ops' \(built-in\) must run before 'fold'"):
        resolve_pipeline(registry, Context(table, {}), ["fold", "contrib-ops"])
    assert resolve_pipeline(registry, Context(table, {}), ["contrib-ops", "fold"]).names == ["contrib-ops", "fold"]

    class Needs(Pass):
        name, requires = "needs-fold", ("fold",)

    class Typo(Pass):
        name, before = "typo-order", ("flod",)

    registry.passes.update({"needs-fold": Needs, "typo-order": Typo})
    with pytest.raises(InputError, match=r"pass 'needs-fold' .* requires 'fold' to run before it, absent from"):
        resolve_pipeline(registry, Context(table, {}), ["needs-fold"])
    with pytest.raises(InputError, match=r"requires 'fold' to run before it, later in"):
        resolve_pipeline(registry, Context(table, {}), ["needs-fold", "fold"])
    with pytest.raises(InputError, match=r"pass 'typo-order' .*: before 'flod' names no pass"):
        resolve_pipeline(registry, Context(table, {}), ["typo-order"])


def test_analyses_are_cached_until_a_pass_changes_the_graph(small, table):
    """One count per graph state: a pass that changes nothing or preserves it keeps the cached one."""

    def op_count(graph):
        return len(graph.nodes)

    seen = []

    class Look(Pass):
        name = "look"

        def run(self, graph, ctx):
            seen.append(ctx.analysis(op_count, graph))
            return PassResult()

    class DropIdentity(Look):
        name = "drop-identity"

        def run(self, graph, ctx):
            node = next(n for n in graph.nodes if n.op == "Identity")
            node.outputs[0].outputs[0].inputs[0] = node.inputs[0]
            node.outputs.clear()
            return PassResult(rewrites=1)

    class Keeps(DropIdentity):
        name, preserves = "keeps", ("op_count",)

    model = load(small)
    ctx = Context(table, {}, model.root, model.values)
    run_pipeline(model.graph, Pipeline([Look(), Look(), DropIdentity(), Look()], []), ctx)
    assert seen == [4, 4, 3] and ctx.analyses.computed == {"op_count": 2}
    ctx, seen[:] = Context(table, {}, model.root, model.values), []
    model = load(small)
    run_pipeline(model.graph, Pipeline([Look(), Keeps(), Look()], []), ctx)
    assert seen == [4, 4] and ctx.analyses.computed == {"op_count": 1}  # (declared preserved: kept, stale)


# --- config ---------------------------------------------------------------------------------


def test_config_files_and_cli_override(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.mtkc]\nsdk = "7.0"\nskip_passes = ["rope"]\n')
    assert dict(load_config(cwd=tmp_path).values) == {"sdk": "7.0", "skip_passes": ["rope"]}
    (tmp_path / "mtkc.toml").write_text(
        'sdk = "8.0"\nseq_len = 16\nplugins = ["mine.py"]\n[input_shapes]\ninput_ids = [1, 16]\n'
        '[pass_options.mine]\nlevel = 2\n'
    )
    (tmp_path / "mine.py").write_text("")
    config = load_config(cwd=tmp_path)  # mtkc.toml wins over pyproject.toml
    options = build([config])
    assert (options.sdk, options.seq_len, options.plugins, dict(options.input_shapes)) == (
        "8.0", 16, (str(tmp_path / "mine.py"),), {"input_ids": (1, 16)})
    assert dict(options.for_pass("mine")) == {"level": 2} and dict(options.for_pass("other")) == {}
    merged = build([config, Layer({"sdk": None, "seq_len": 32, "plugins": None, "skip_passes": ["fold"]}, "cli")])
    assert (merged.sdk, merged.seq_len, merged.plugins, merged.skip_passes) == (
        "8.0", 32, (str(tmp_path / "mine.py"),), ("fold",))


@pytest.mark.parametrize(
    "text, message",
    [
        ("sdk = '8.0'\npass = ['fold']\n", "mtkc.toml: unknown key 'pass'; known keys: sdk, arch, seq_len"),
        ("seq_len = 'long'\n", "mtkc.toml:seq_len: expected an integer in 1..131072, got 'long'"),
        ("seq_len = 0\n", "mtkc.toml:seq_len: expected an integer in 1..131072, got 0"),
        ("force_cpu = 5\n", "mtkc.toml:force_cpu: expected a list of names, got 5"),
        ("[input_shapes]\ninput_ids = [1, true]\n", "mtkc.toml:input_shapes: expected a table of input name"),
        ("rope_mode = 'banana'\n", "mtkc.toml:rope_mode: expected one of table, pos_emb, got 'banana'"),
        ("mask_value = 5.0\n", "mtkc.toml:mask_value: expected a finite negative number"),
        ("mask_value = nan\n", "mtkc.toml:mask_value: expected a finite negative number"),
        ("overwrite = true\n", "unknown key 'overwrite'"),
        ("variant = 'decode'\n", "unknown key 'variant'"),
        ("sdk = \n", "not a readable TOML file"),
    ],
)
def test_bad_config_is_an_input_error(tmp_path, text, message):
    path = tmp_path / "mtkc.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        build([load_config(path)])


def test_binary_config_is_an_input_error(tmp_path):
    path = tmp_path / "mtkc.toml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(InputError, match="not a readable TOML file"):
        load_config(path)


# --- invariants -----------------------------------------------------------------------------


def test_dangling_tensor_names_pass_and_tensor(small, table):
    with pytest.raises(PassError, match="pass 'drop-producer': graph output 'y' is not produced by any node"):
        run(small, table, ["drop-producer"], [plugin("dangling")])


class _Inline(Pass):
    """Test-local passes (not registered): run through a hand-built Pipeline."""


def run_local(path: Path, table, *passes: Pass, verify_each=False):
    model = load(path)
    ctx = Context(table, {}, model.root, model.values)
    return model, run_pipeline(model.graph, Pipeline(list(passes), []), ctx, verify_each=verify_each)


class AddUnnamed(_Inline):
    """Inserts Relu(Relu) after the last node: one unnamed node, one named like an existing one."""

    name = "add-unnamed"

    def run(self, graph, ctx):
        y = graph.outputs[0]
        relu = y.inputs[0]
        mid, mid2 = gs.Variable("mid", np.float32, y.shape), gs.Variable("mid2", np.float32, y.shape)
        relu.outputs = [mid]
        graph.nodes += [gs.Node("Relu", inputs=[mid], outputs=[mid2]), gs.Node("Relu", name="relu", inputs=[mid2], outputs=[y])]
        return PassResult(rewrites=1)


def test_unnamed_and_duplicate_nodes_get_pass_derived_names(small, table):
    model, _ = run_local(small, table, AddUnnamed())
    assert [n.name for n in model.graph.nodes] == ["mm", "id", "add", "relu", "add-unnamed/Relu", "add-unnamed/relu"]


class MakeCycle(_Inline):
    name = "make-cycle"

    def run(self, graph, ctx):
        mm = next(n for n in graph.nodes if n.name == "mm")
        add = next(n for n in graph.nodes if n.name == "add")
        mm.inputs[0] = add.outputs[0]
        return PassResult(rewrites=1)


def test_cycle_is_named(small, table):
    with pytest.raises(PassError, match="pass 'make-cycle': the graph has a cycle through node"):
        run_local(small, table, MakeCycle())


class Untyped(_Inline):
    """Inserts Relu with an untyped, shapeless output into a bound graph (inference fills it)."""

    name = "untyped"

    def run(self, graph, ctx):
        y = graph.outputs[0]
        inner = gs.Variable("inner")
        y.inputs[0].outputs = [inner]
        graph.nodes.append(gs.Node("Neg", name="neg", inputs=[inner], outputs=[y]))
        return PassResult(rewrites=1)


class CustomOpUntyped(Untyped):
    """Like Untyped but through an op ONNX cannot infer: the invariant must name the tensor."""

    name = "custom-untyped"

    def run(self, graph, ctx):
        result = super().run(graph, ctx)
        graph.nodes[-1].op, graph.nodes[-1].domain = "Mystery", "com.example"
        graph.outputs[0].dtype = None
        return result


def test_untyped_tensors_are_inferred_or_named(small, table):
    bound = _bind(small)
    model, _ = run_local(bound, table, Untyped())
    inner = model.graph.tensors()["inner"]
    assert inner.dtype == np.float32 and list(inner.shape) == [2, 4]
    with pytest.raises(PassError, match="pass 'custom-untyped': tensor 'y' has no dtype"):
        run_local(bound, table, CustomOpUntyped())


def _bind(path: Path) -> Path:
    """The small model with N bound to 2 (all tensors typed by ONNX inference)."""
    model = onnx.load(path)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    model = onnx.shape_inference.infer_shapes(model)
    out = path.parent.parent / "bound" / "model.onnx"
    out.parent.mkdir()
    onnx.save(model, out)
    return out


# --- verify-each ----------------------------------------------------------------------------


def test_verify_each_names_the_pass_that_changes_numbers(small, table):
    with pytest.raises(MismatchError, match=r"--verify-each: pass 'negate-output' changed the numbers: output 'y' max abs error"):
        run(small, table, ["strip-identity", "negate-output"], [plugin("strip_identity"), plugin("negate_output")], verify_each=True)
    _, records = run(small, table, ["negate-output"], [plugin("negate_output")])  # without the flag it runs
    assert records[0].rewrites == 1


class RenameInput(_Inline):
    """Renames input x -> x_scaled and halves it inside; map_feeds doubles the feed to match."""

    name = "rename-input"
    mapped = True

    def run(self, graph, ctx):
        x = graph.inputs[0]
        new = gs.Variable("x_scaled", x.dtype, x.shape)
        two = gs.Constant("two", np.array(2.0, np.float32))
        graph.nodes.insert(0, gs.Node("Mul", name="unscale", inputs=[new, two], outputs=[x]))
        graph.inputs = [new]
        return PassResult(rewrites=1)

    def map_feeds(self, feeds, ctx):
        if not self.mapped:
            return feeds
        return {"x_scaled": feeds["x"] / 2}


class RenameInputUnmapped(RenameInput):
    mapped = False


def test_io_changing_pass_maps_feeds(small, table):
    model, records = run_local(small, table, RenameInput(), verify_each=True)
    assert [t.name for t in model.graph.inputs] == ["x_scaled"]
    with pytest.raises(PassError, match="pass 'rename-input' added input 'x_scaled' but does not map feeds"):
        run_local(small, table, RenameInputUnmapped(), verify_each=True)


# --- idempotency: every built-in pass, run twice in the default pipeline, rewrites 0 the second time


DOUBLED = {
    "nocache": (False, {"seq_len": 8}),
    "kv": (True, {"seq_len": 8, "cache_len": 16, "kv_cache": True, "chunks": 2, "chunk": 1}),
}


@pytest.fixture(scope="module", params=sorted(DOUBLED))
def doubled(request, exported, table):
    """The default pipeline on a tiny Qwen2 export, every pass run twice in a row:
    {name: (first record, second record) or the PassError that stopped the pipeline there}."""
    cache, options = DOUBLED[request.param]
    model = load(exported("qwen2", "legacy17", cache=cache))
    ctx = Context(table, options, model.root, model.values)
    results = {}
    for first in resolve_pipeline(load_registry(), ctx).passes:
        again = [type(first)()] if first.idempotent else []
        try:
            results[first.name] = tuple(run_pipeline(model.graph, Pipeline([first, *again], []), ctx))
        except MtkcError as exc:
            results[first.name] = exc
            break
    return results


@pytest.mark.parametrize("name", sorted(builtin_passes()))
def test_builtin_pass_is_idempotent(doubled, name):
    if name not in doubled:
        pytest.skip(f"'{name}' did not run on this export (not in its pipeline, or an earlier pass failed)")
    if isinstance(doubled[name], MtkcError):
        pytest.fail(str(doubled[name]))
    if not builtin_passes()[name].idempotent:
        pytest.skip(f"'{name}' declares idempotent = False")
    first, second = doubled[name]
    assert second.rewrites == 0, f"{name}: {first.rewrites} rewrites, then {second.rewrites} more"
    assert second.nodes_before == second.nodes_after == first.nodes_after


def test_default_pipeline_keeps_numbers_on_tiny_export(exported, table):
    """verify_each compares every changing pass with the export (through map_feeds hooks)."""
    model, records = run(exported("qwen2", "legacy17"), table, None, options={"seq_len": 8}, verify_each=True)
    assert {"bind-shapes", "fold", "rmsnorm"} <= {r.name for r in records if r.rewrites}
    outputs = execute.run(model.graph, execute.seeded_inputs(model.graph, 0), model.root)
    assert outputs["logits"].shape == (1, 8, model.graph.outputs[0].shape[-1])


# --- entry points ---------------------------------------------------------------------------


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A fake installed distribution `mtkc-demo 0.3` with two `mtkc.passes` entry points."""
    from mtkc.manager import pass_manager

    (tmp_path / "mtkc_demo.py").write_text(
        "from mtkc.rewrite.pass_api import Pass, PassResult\n"
        "class Demo(Pass):\n    name = 'demo-pass'\n    description = 'installed demo'\n"
        "    def run(self, graph, ctx):\n        return PassResult()\n"
        "class Clash(Pass):\n    name = 'fold'\n"
    )
    info = tmp_path / "mtkc_demo-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mtkc-demo\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[mtkc.passes]\ndemo-pass = mtkc_demo:Demo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pass_manager._entry_points.cache_clear()
    yield info
    pass_manager._entry_points.cache_clear()


def test_entry_point_passes_are_listed_but_run_only_when_enabled(installed_plugin, table):
    registry = load_registry()
    assert "demo-pass" in registry.names() and registry.get("demo-pass").origin == "mtkc-demo 0.3"
    ctx = Context(table, {})
    assert "demo-pass" not in resolve_pipeline(registry, ctx).names
    assert resolve_pipeline(load_registry(["demo-pass"]), ctx).names[-1] == "demo-pass"
    assert resolve_pipeline(registry, ctx, ["demo-pass"]).names == ["demo-pass"]


def test_entry_point_name_clash_names_both(installed_plugin):
    (installed_plugin / "entry_points.txt").write_text("[mtkc.passes]\nfold = mtkc_demo:Clash\n")
    with pytest.raises(PassError, match=r"pass name 'fold' is registered twice: by built-in \(mtkc.passes.fold.*\) and by mtkc-demo 0.3"):
        load_registry()


def test_plugin_given_as_a_module(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    registry = load_registry(["strip_identity"])
    assert registry.get("strip-identity").origin == "plugin strip_identity" and registry.enabled == ["strip-identity"]


def _snapshot(graph: gs.Graph, typed: bool = False) -> tuple:
    """The graph's structure: nodes, attributes, tensor names and kinds, I/O; with `typed` also every
    tensor's dtype and shape (which shape inference in an idle pass may fill in)."""
    def tensor(t):
        return (t.name, type(t).__name__) + ((str(t.dtype), repr(t.shape)) if typed else ())

    nodes = tuple((n.name, n.op, n.domain, tuple(map(tensor, n.inputs)), tuple(map(tensor, n.outputs)),
                   repr(sorted(n.attrs.items()))) for n in graph.nodes)
    return nodes, tuple(map(tensor, graph.inputs)), tuple(map(tensor, graph.outputs))


@pytest.mark.parametrize("family, exporter, cache, options", [
    ("qwen2", "legacy17", True, {"seq_len": 8, "cache_len": 64}),
    ("qwen2", "dynamo", False, {"seq_len": 8, "kv_cache": True, "cache_len": 64}),
    ("llama", "legacy14", False, {"seq_len": 8}),
])
def test_a_builtin_pass_that_rewrote_nothing_left_the_graph_as_it_was(exported, family, exporter, cache, options):
    """The pass manager skips restoring/checking invariants after such a pass; this holds it to that.
    A pass it reports untouched (`observe`'s third argument; check's tracker then judges nothing
    again) left every dtype and shape as well."""
    from mtkc.pipeline.build import build as build_graphs

    model = load(exported(family, exporter, cache=cache))
    seen: list[tuple] = []
    result = build_graphs(model, Options(**options), load_table("8.0"), raw=False,
                          observe=lambda p, graph, touched: seen.append((p.name, _snapshot(graph),
                                                                         _snapshot(graph, typed=True), touched)))
    records = result.variants[0].compiled.records
    assert [r.name for r in records] == [s[0] for s in seen]
    idle = [i for i, r in enumerate(records) if i and r.rewrites == 0]  # the first: no snapshot before it
    assert idle, "the pipeline has passes that rewrite nothing on this export"
    for i in idle:
        assert seen[i][1] == seen[i - 1][1], f"pass '{records[i].name}' reported 0 rewrites but changed the graph"
    untouched = [i for i, s in enumerate(seen) if i and not s[3]]
    assert untouched, "the pipeline has passes that leave the graph as it was on this export"
    for i in untouched:
        assert seen[i][2] == seen[i - 1][2], f"pass '{records[i].name}' reported untouched but retyped the graph"
