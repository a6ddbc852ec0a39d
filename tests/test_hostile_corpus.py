"""The hostile corpus (issue 12): unusual inputs and faults, built by code, run in-process.

Each case runs in its own folder of a shared arena and asserts the exit code, a one-line error
(no traceback, no exit 4), what was or was not written, and that nothing outside its folder
changed. Classes (issue 12): 1 overwrite, 2 graphs that do not run, 3 I/O contract, 4 the user's
own conditions, 5 names reaching the terminal, 6 invalid ONNX, 8 converter hand-off, 9 paths a
manifest names, 10 plugins. (Class 7, option values, is tested with the options.)
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from hostile_kit import assert_contract, make_model, run_cli, save, snapshot, tiny, with_cpu_node
from onnx import TensorProto, helper, numpy_helper

SDK = "8.0"
CASES: dict[str, tuple[str, Callable]] = {}
STANDIN = Path(__file__).with_name("standin_converter.py")


def case(cls: str, name: str):
    def add(fn):
        assert name not in CASES
        CASES[name] = (cls, fn)
        return fn

    return add


def compile_args(model: Path, out: Path, *extra) -> list:
    return ["compile", model, "--sdk", SDK, "-o", out, "--no-convert", *extra]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ class 1: --overwrite


def _foreign(setup: Callable[[Path], None], says: str):
    def run(d: Path, mp) -> None:
        model = save(tiny(), d / "m.onnx")
        out = d / "v"
        out.mkdir()
        setup(out)
        before = files_of(out)
        r = run_cli(compile_args(model, out, "--overwrite"))
        assert_contract(r, 2, says)
        assert files_of(out) == before  # every file of the user's is still there, unchanged
        assert sorted(p.name for p in d.iterdir()) == ["m.onnx", "v"]  # no staging left

    return run


def _manifest(data) -> Callable[[Path], None]:
    return lambda out: (out / "manifest.json").write_text(json.dumps(data))


FOREIGN = {
    "thesis": (lambda o: (o / "thesis.tex").write_text("work"), "no readable manifest.json"),
    "git-repo": (lambda o: ((o / ".git").mkdir(), (o / ".git" / "HEAD").write_text("ref")), "no readable manifest.json"),
    "weights-only": (lambda o: (o / "weights.bin").write_bytes(b"\0" * 8), "no readable manifest.json"),
    "onnx-only": (lambda o: (o / "model.onnx").write_bytes(b"x"), "no readable manifest.json"),
    "manifest-not-json": (lambda o: (o / "manifest.json").write_text("{oops"), "no readable manifest.json"),
    "manifest-list": (_manifest([1, 2]), "manifest.json is not mtkc's"),
    "manifest-no-mark": (_manifest({"schema_version": 1, "graphs": []}), "manifest.json is not mtkc's"),
    "manifest-no-schema": (_manifest({"mtkc": "1"}), "manifest.json is not mtkc's"),
    "manifest-binary": (lambda o: (o / "manifest.json").write_bytes(b"\xff\xfe\0"), "no readable manifest.json"),
    "mtkc-plus-user-file": (lambda o: (_manifest({"schema_version": 1, "mtkc": "1"})(o), (o / "notes.txt").write_text("n")),
                            "holds 'notes.txt'"),
    "mtkc-plus-user-folder": (lambda o: (_manifest({"schema_version": 1, "mtkc": "1"})(o), (o / "data").mkdir(),
                                         (o / "data" / "x.csv").write_text("1")), "holds 'data/x.csv'"),
    "mtkc-plus-symlink": (lambda o: (_manifest({"schema_version": 1, "mtkc": "1"})(o), (o / "report.md").symlink_to("/etc/hostname")),
                          "holds 'report.md'"),
    "mtkc-plus-hidden": (lambda o: (_manifest({"schema_version": 1, "mtkc": "1"})(o), (o / ".env").write_text("KEY=1")),
                         "holds '.env'"),
    "mtkc-plus-onnx-data": (lambda o: (_manifest({"schema_version": 1, "mtkc": "1"})(o), (o / "x.onnx.data").write_bytes(b"1")),
                            "holds 'x.onnx.data'"),
}
for _name, (_setup, _says) in FOREIGN.items():
    case("1", f"overwrite-refuses-{_name}")(_foreign(_setup, _says))


@case("1", "overwrite-out-is-a-file")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "v").write_text("mine")
    assert_contract(run_cli(compile_args(model, d / "v", "--overwrite")), 2, "exists and is not a folder")
    assert (d / "v").read_text() == "mine"


@case("1", "overwrite-out-is-a-symlink")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "real").mkdir()
    (d / "real" / "keep.txt").write_text("k")
    (d / "v").symlink_to(d / "real")
    assert_contract(run_cli(compile_args(model, d / "v", "--overwrite")), 2, "exists and is not a folder")
    assert (d / "real" / "keep.txt").read_text() == "k" and (d / "v").is_symlink()


@case("1", "overwrite-dot-in-a-user-folder")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "work").mkdir()
    (d / "work" / "a.txt").write_text("a")
    assert_contract(run_cli(compile_args(model, ".", "--overwrite"), cwd=d / "work"), 2, "not a folder mtkc wrote")
    assert (d / "work" / "a.txt").read_text() == "a"


@case("1", "overwrite-the-model-folder")
def _(d, mp):
    model = save(tiny(), d / "src" / "m.onnx")
    assert_contract(run_cli(compile_args(model, d / "src", "--overwrite")), 2, "overlaps the input model")
    assert [p.name for p in (d / "src").iterdir()] == ["m.onnx"]


@case("1", "no-overwrite-flag")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "v").mkdir()
    assert_contract(run_cli(compile_args(model, d / "v")), 2, "pass --overwrite")


@case("1", "overwrite-replaces-mtkc-output")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    assert_contract(run_cli(compile_args(model, d / "v")), 0)
    graph = json.loads((d / "v" / "manifest.json").read_text())["graphs"][0]
    (d / "v" / "logs").mkdir()
    (d / "v" / "logs" / f"{graph['name']}.{graph['partitions'][0]['id']}.log").write_text("old")  # a converter log: mtkc's
    assert_contract(run_cli(compile_args(model, d / "v", "--overwrite")), 0)
    assert not (d / "v" / "logs").exists() and (d / "v" / "manifest.json").is_file()


@case("1", "overwrite-empty-folder")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "v").mkdir()
    assert_contract(run_cli(compile_args(model, d / "v", "--overwrite")), 0)
    assert json.loads((d / "v" / "manifest.json").read_text())["mtkc"]


# ------------------------------------------------------------------ class 2: graphs that run


def _runs(d: Path, model: onnx.ModelProto, *extra) -> None:
    """Compile exits 0 and verify compares something and says ok (the graphs run)."""
    path = save(model, d / "m.onnx")
    assert_contract(run_cli(compile_args(path, d / "out", *extra)), 0)
    r = run_cli(["verify", d / "out"])
    assert_contract(r, 0)
    assert " ok" in r.out and "MISMATCH" not in r.out


@case("2", "local-function-in-a-partition")
def _(d, mp):
    f = helper.make_function("local", "MyRelu", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                             [helper.make_opsetid("", 17)])
    m = make_model([helper.make_node("MyRelu", ["x"], ["y"], domain="local", name="fn")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], functions=[f], domains=["local"])
    _runs(d, m)


@case("2", "nested-local-functions")
def _(d, mp):
    inner = helper.make_function("local", "Inner", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                                 [helper.make_opsetid("", 17)])
    outer = helper.make_function("local", "Outer", ["a"], ["b"], [helper.make_node("Inner", ["a"], ["b"], domain="local")],
                                 [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    m = make_model([helper.make_node("Outer", ["x"], ["h"], domain="local", name="fn"),
                    helper.make_node("Hardmax", ["h"], ["y"], name="hm")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                   functions=[inner, outer], domains=["local"])
    _runs(d, m)


@case("2", "graph-output-is-an-initializer")
def _(d, mp):
    c = numpy_helper.from_array(np.ones((1, 4), np.float32), "c")
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
                    helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4])], [c])
    _runs(d, m)


@case("2", "graph-output-is-a-graph-input")
def _(d, mp):
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
                    helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])])
    _runs(d, m)


@case("2", "loop-trip-count-stays-int64")
def _(d, mp):
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_in", "one"], ["acc_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.ones((1, 4), np.float32), "one")])
    m = make_model([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                   [numpy_helper.from_array(np.array(3, np.int64), "n")])
    _runs(d, m)


@case("2", "float8-cast-does-not-survive-opset17")
def _(d, mp):
    m = make_model([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT8E4M3FN, name="to_f8"),
                    helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT, name="from_f8")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], opset=19)
    path = save(m, d / "m.onnx")
    r = run_cli(compile_args(path, d / "out"))
    if r.code == 0:  # lowered or sent to the CPU: it must then run
        assert_contract(run_cli(["verify", d / "out"]), 0)
    else:
        assert_contract(r, 2, "_f8)")  # the node is named
        assert not (d / "out").exists()


@case("2", "a-pass-that-breaks-the-graph-is-caught-before-the-swap")
def _(d, mp):
    import mtkc.backend.stitch as stitch

    real = stitch.cut

    def broken(graph, parts, placements, name):
        pieces = real(graph, parts, placements, name)
        for piece in pieces:
            for node in piece.graph.nodes:
                node.op = "NoSuchOp"  # a piece onnxruntime cannot run
        return pieces

    mp.setattr(stitch, "cut", broken)
    path = save(tiny(), d / "m.onnx")
    assert_contract(run_cli(compile_args(path, d / "out")), 2, "does not run in onnxruntime")
    assert not (d / "out").exists() and [p.name for p in d.iterdir()] == ["m.onnx"]


# ------------------------------------------------------------------ class 3: the I/O contract


def _plugin(d: Path, stem: str, body: str, changes_io: bool = False) -> Path:
    path = d / f"{stem}.py"
    path.write_text(textwrap.dedent(f"""\
        import numpy as np
        import onnx_graphsurgeon as gs
        from mtkc.rewrite.pass_api import Pass, PassResult, register

        @register
        class P(Pass):
            name = "{stem.replace('_', '-')}"
            description = "hostile test plugin"
            changes_io = {changes_io}

            def run(self, graph, ctx):
        """) + textwrap.indent(textwrap.dedent(body).rstrip("\n") + "\n", " " * 8) + "        return PassResult(rewrites=1)\n")
    return path


IO_CHANGES = {
    "rename-input": ("graph.inputs[0].name = 'renamed'", "removed or renamed 'x'"),
    "rename-output": ("graph.outputs[0].name = 'renamed'", "removed or renamed 'y'"),
    "drop-output": ("graph.outputs.append(graph.nodes[0].outputs[0])\ngraph.outputs.pop(0)", "removed or renamed 'y'"),
    "add-output": ("graph.outputs.append(graph.nodes[0].outputs[0])", "added 'm'"),
    "retype-input": ("graph.inputs[0].dtype = np.float16", "changed the dtype of 'x'"),
    "retype-output": ("graph.outputs[0].dtype = np.float64", "changed the dtype of 'y'"),
    "reshape-input": ("graph.inputs[0].shape = [2, 4]", "changed the shape of 'x'"),
    "reshape-output": ("graph.outputs[0].shape = [1, 4, 1]", "changed the shape of 'y'"),
    "add-input": ("graph.inputs.append(gs.Variable('extra', np.float32, [1]))", "added 'extra'"),
    "reorder-outputs": ("graph.outputs.append(graph.nodes[0].outputs[0])\ngraph.outputs.reverse()", "added 'm'"),
}
for _name, (_body, _says) in IO_CHANGES.items():
    def _io(d, mp, body=_body, says=_says, stem=f"io_{_name.replace('-', '_')}"):
        plugin = _plugin(d, stem, body)
        model = save(tiny(), d / "m.onnx")
        assert_contract(run_cli(compile_args(model, d / "out", "--plugin", plugin)), 2, says)
        r = run_cli(compile_args(model, d / "out", "--plugin", plugin))
        assert f"pass '{stem.replace('_', '-')}'" in r.err
        assert not (d / "out").exists()

    case("3", f"io-{_name}")(_io)


@case("3", "io-declared-change-is-allowed")
def _(d, mp):
    plugin = _plugin(d, "io_declared", "graph.outputs[0].name = 'renamed'", changes_io=True)
    model = save(tiny(), d / "m.onnx")
    assert_contract(run_cli(compile_args(model, d / "out", "--plugin", plugin)), 0)
    manifest = json.loads((d / "out" / "manifest.json").read_text())
    assert [o["name"] for o in manifest["graphs"][0]["outputs"]] == ["renamed"]


@case("3", "io-unshaped-output-is-inferred-again")
def _(d, mp):
    plugin = _plugin(d, "io_unshape", "graph.outputs[0].shape = None")  # the manager infers it back
    model = save(tiny(), d / "m.onnx")
    assert_contract(run_cli(compile_args(model, d / "out", "--plugin", plugin)), 0)
    manifest = json.loads((d / "out" / "manifest.json").read_text())
    assert manifest["graphs"][0]["outputs"][0]["shape"] == [1, 4]


@case("3", "io-binding-a-dim-is-a-refinement")
def _(d, mp):
    m = tiny()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    model = save(m, d / "m.onnx")
    assert_contract(run_cli(compile_args(model, d / "out")), 0)


# ------------------------------------------------------------------ class 4: the user's own conditions


def _model_case(model_fn: Callable[[], onnx.ModelProto], says: str, command: str = "compile"):
    def run(d, mp):
        path = save(model_fn(), d / "m.onnx")
        args = compile_args(path, d / "out") if command == "compile" else ["check", path, "--sdk", SDK]
        assert_contract(run_cli(args), 2, says)
        assert not (d / "out").exists()

    return run


def _sparse() -> onnx.ModelProto:
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "s")
    indices = numpy_helper.from_array(np.array([0, 3], np.int64), "s_idx")
    m = make_model([helper.make_node("Add", ["x", "s"], ["y"], name="add")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    return m


def _attr(op: str, inputs: list[str], attr: onnx.AttributeProto, out_shape=(1, 4)) -> Callable[[], onnx.ModelProto]:
    def build():
        node = helper.make_node(op, inputs, ["y"], name="bad_attr")
        node.attribute.append(attr)
        return make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))])

    return build


USER_MODELS = {
    "sparse-initializer": (_sparse, "sparse initializer 's'"),
    "softmax-axis-string": (_attr("Softmax", ["x"], helper.make_attribute("axis", "last")), "Mismatched attribute type"),
    "transpose-perm-floats": (_attr("Transpose", ["x"], helper.make_attribute("perm", [1.0, 0.0]), (4, 1)), "Mismatched attribute type"),
    "gather-axis-float": (_attr("Flatten", ["x"], helper.make_attribute("axis", 1.5)), "Mismatched attribute type"),
    "leakyrelu-alpha-string": (_attr("LeakyRelu", ["x"], helper.make_attribute("alpha", "0.1")), "Mismatched attribute type"),
    "concat-axis-tensor": (_attr("Concat", ["x", "x"], helper.make_attribute("axis", numpy_helper.from_array(np.array(1, np.int64))), (1, 8)),
                           "Mismatched attribute type"),
}
for _name, (_fn, _says) in USER_MODELS.items():
    case("4", f"user-{_name}")(_model_case(_fn, _says))
    case("4", f"user-{_name}-check")(_model_case(_fn, _says, "check"))


@case("4", "out-under-a-file")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "afile").write_text("x")
    assert_contract(run_cli(compile_args(model, d / "afile" / "sub")), 2, "cannot write the output folder")
    assert (d / "afile").read_text() == "x"


def _disk_fault(target: str, err: int, says: str):
    def run(d, mp):
        model = save(tiny(), d / "m.onnx")

        def fail(*args, **kwargs):
            raise OSError(err, os.strerror(err))

        mp.setattr(target, fail)
        assert_contract(run_cli(compile_args(model, d / "out")), 2, says)
        assert sorted(p.name for p in d.iterdir()) == ["m.onnx"]  # no OUT, no staging

    return run


DISK_FAULTS = {
    "read-only-fs": ("tempfile.mkdtemp", errno.EROFS, "Read-only file system"),
    "permission-denied": ("tempfile.mkdtemp", errno.EACCES, "Permission denied"),
    "full-while-writing-weights": ("mtkc.ir.weights.WeightWriter.export", errno.ENOSPC, "No space left on device"),
    "full-while-writing-reports": ("mtkc.backend.deliver._write", errno.ENOSPC, "No space left on device"),
    "full-while-writing-overlay": ("mtkc.backend.report.overlay", errno.ENOSPC, "No space left on device"),
    "quota-while-writing-script": ("mtkc.backend.handoff._write_script", errno.EDQUOT, "Disk quota exceeded"),
    "file-too-large": ("mtkc.ir.weights.WeightWriter.export", errno.EFBIG, "File too large"),
    "read-only-at-swap": ("mtkc.backend.staging.os.rename", errno.EROFS, "Read-only file system"),
}
for _name, (_target, _err, _says) in DISK_FAULTS.items():
    case("4", f"disk-{_name}")(_disk_fault(_target, _err, _says))


@case("4", "out-is-dot-in-an-empty-folder")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    (d / "here").mkdir()
    assert_contract(run_cli(compile_args(model, ".", "--overwrite"), cwd=d / "here"), 0)
    assert (d / "here" / "manifest.json").is_file()


@case("4", "converter-deletes-its-folder")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    script = d / "rm.sh"
    script.write_text('#!/bin/sh\nrm -rf "$PWD"\n')
    script.chmod(0o755)
    r = run_cli(["compile", model, "--sdk", SDK, "-o", d / "out", "--converter-cmd", f"{script} {{input}} {{output}}"])
    assert_contract(r, 2, "removed its working folder")
    assert sorted(p.name for p in d.iterdir()) == ["m.onnx", "rm.sh"]


@pytest.fixture(scope="session")
def base_out(tmp_path_factory) -> Path:
    """A compiled OUT (tiny model; one NPU and one CPU partition) to copy and tamper with."""
    root = tmp_path_factory.mktemp("hostile-base")
    model = save(with_cpu_node("hm"), root / "src" / "m.onnx")
    assert_contract(run_cli(compile_args(model, root / "out")), 0)
    return root / "out"


def _tampered(edit: Callable[[Path], None], says: str, command: str = "verify"):
    def run(d, mp, base):
        out = d / "out"
        shutil.copytree(base, out)
        edit(out)
        before = files_of(out)
        args = ["verify", out] if command == "verify" else ["generate", out, "--prompt-ids", "1,2"]
        assert_contract(run_cli(args), 2, says)
        assert files_of(out) == before  # verify writes nothing

    run.needs_base = True
    return run


def _edit_manifest(fn) -> Callable[[Path], None]:
    def edit(out: Path) -> None:
        data = json.loads((out / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps(fn(data)))

    return edit


def _graph0(**changes):
    return _edit_manifest(lambda m: {**m, "graphs": [{**m["graphs"][0], **changes}] + m["graphs"][1:]})


def _part0(**changes):
    def fn(m):
        g = m["graphs"][0]
        return {**m, "graphs": [{**g, "partitions": [{**g["partitions"][0], **changes}] + g["partitions"][1:]}]}

    return _edit_manifest(fn)


def _truncate(name: str, keep: int = 8) -> Callable[[Path], None]:
    def edit(out: Path) -> None:
        data = (out / name).read_bytes()
        (out / name).write_bytes(data[:keep])

    return edit


TAMPERED = {
    "manifest-list": (_edit_manifest(lambda m: [m]), "expected a JSON object"),
    "manifest-string": (_edit_manifest(lambda m: "x"), "expected a JSON object"),
    "manifest-null": (_edit_manifest(lambda m: None), "expected a JSON object"),
    "manifest-garbage": (lambda o: (o / "manifest.json").write_bytes(b"\x00\xff garbage"), "manifest.json"),
    "manifest-missing": (lambda o: (o / "manifest.json").unlink(), "no manifest.json"),
    "no-schema-version": (_edit_manifest(lambda m: {k: v for k, v in m.items() if k != "schema_version"}), "schema_version"),
    "no-graphs": (_edit_manifest(lambda m: {k: v for k, v in m.items() if k != "graphs"}), "graphs"),
    "graphs-empty": (_edit_manifest(lambda m: {**m, "graphs": []}), "graphs"),
    "graphs-string": (_edit_manifest(lambda m: {**m, "graphs": "model"}), "graphs"),
    "graph-not-object": (_edit_manifest(lambda m: {**m, "graphs": [3]}), "graphs[0]"),
    "graph-no-name": (_graph0(name=None), "graphs[0].name"),
    "graph-path-int": (_graph0(path=5), "graphs[0].path"),
    "graph-inputs-missing": (_graph0(inputs=None), "graphs[0].inputs"),
    "graph-input-not-object": (_graph0(inputs=["x"]), "graphs[0].inputs[0]"),
    "graph-input-huge-shape": (_graph0(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 2**40]}]), "shape"),
    "graph-input-negative-dim": (_graph0(inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 4]}]), "shape"),
    "graph-input-bad-from": (_graph0(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4], "from": "g"}]), "from"),
    "partitions-missing": (_graph0(partitions=None), "partitions"),
    "partition-bad-target": (_part0(target="gpu"), "target"),
    "partition-no-id": (_part0(id=7), ".id"),
    "partition-file-missing": (lambda o: (o / json.loads((o / "manifest.json").read_text())["graphs"][0]["partitions"][0]
                                          ["path"]).unlink(), "missing"),
    "host-not-object": (_edit_manifest(lambda m: {**m, "host": [1]}), "host"),
    "options-not-object": (_edit_manifest(lambda m: {**m, "options": 3}), "options"),
    "weights-truncated": (_truncate("weights.bin"), "exceeds the size"),
    "weights-missing": (lambda o: (o / "weights.bin").unlink(), "missing"),
    "graph-file-garbage": (lambda o: (o / "model.onnx").write_bytes(b"\x08\x01garbage\xff\xff"), "model.onnx"),
    "graph-file-empty": (lambda o: (o / "model.onnx").write_bytes(b""), "model.onnx"),
}
for _name, (_edit, _says) in TAMPERED.items():
    case("4", f"tampered-{_name}")(_tampered(_edit, _says))


@case("4", "pickled-npy-host-table")
def _(d, mp, base):
    out = d / "out"
    shutil.copytree(base, out)
    (out / "host").mkdir()
    with open(out / "host" / "embedding.npy", "wb") as f:
        np.save(f, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    _edit_manifest(lambda m: {**m, "host": {"embedding": {"path": "host/embedding.npy", "dtype": "float32", "shape": [1]}}})(out)
    assert_contract(run_cli(["verify", out]), 2, "not a plain .npy array")


@case("4", "raw-pickle-as-npy")
def _(d, mp, base):
    out = d / "out"
    shutil.copytree(base, out)
    (out / "host").mkdir()
    (out / "host" / "rope.npy").write_bytes(pickle.dumps({"evil": 1}))
    _edit_manifest(lambda m: {**m, "host": {"rope": {"path": "host/rope.npy", "dtype": "float32", "shape": [1]}}})(out)
    assert_contract(run_cli(["verify", out]), 2, "not a plain .npy array")


# ------------------------------------------------------------------ class 5: names reaching the terminal

BAD_CHARS = {
    "esc-colour": "\x1b[31mred\x1b[0m",
    "clear-screen": "\x1b[2J\x1b[H",
    "osc-title": "\x1b]0;pwned\x07",
    "bel": "ding\x07",
    "cr": "one\rtwo",
    "lf-fake-ok": "x\nmtkc: ok: all good",
    "del": "a\x7fb",
    "c1-csi": "a\x9b31mb",
    "c1-nel": "a\x85b",
    "rlo": "abc\u202etxt.exe",
    "lri": "a\u2066b\u2069",
    "lrm": "a\u200eb\u200f",
    "alm": "a\u061cb",
    "line-separator": "a\u2028b",
}


def _clean(text: str) -> None:
    for ch in text:
        code = ord(ch)
        assert ch in "\n\t" or not (code < 0x20 or 0x7F <= code < 0xA0), repr(text)
        assert code not in (0x061C, 0x200E, 0x200F, 0x2028, 0x2029) and not 0x202A <= code <= 0x202E \
            and not 0x2066 <= code <= 0x2069, repr(text)


for _name, _text in BAD_CHARS.items():
    def _error_line(d, mp, text=_text):
        m = tiny()
        m.graph.node[1].input[0] = text  # a dangling input named `text`
        path = save(m, d / "m.onnx")
        r = run_cli(["check", path, "--sdk", SDK])
        assert_contract(r, 2)
        _clean(r.err)
        assert len(r.err.splitlines()) == 1

    def _check_table(d, mp, text=_text):
        path = save(with_cpu_node(text), d / "m.onnx")
        r = run_cli(["check", path, "--sdk", SDK])
        assert_contract(r, 0)
        _clean(r.out + r.err)
        assert "Hardmax" in r.out

    def _report_md(d, mp, text=_text):
        path = save(with_cpu_node(text), d / "m.onnx")
        assert_contract(run_cli(compile_args(path, d / "out")), 0)
        md = (d / "out" / "report.md").read_text()
        _clean(md)
        assert "Hardmax" in md

    def _verify_table(d, mp, text=_text):
        path = save(tiny(y=text), d / "m.onnx")
        assert_contract(run_cli(compile_args(path, d / "out")), 0)
        r = run_cli(["verify", d / "out"])
        assert_contract(r, 0)
        _clean(r.out + r.err)
        rows = [line for line in r.out.splitlines() if not line.startswith("skipped: ")]  # e.g. the oracle's
        assert len(rows) == 4  # header, partitions, graph, verdict

    case("5", f"escape-error-{_name}")(_error_line)
    case("5", f"escape-check-table-{_name}")(_check_table)
    case("5", f"escape-report-md-{_name}")(_report_md)
    case("5", f"escape-verify-table-{_name}")(_verify_table)


@case("5", "escape-warning-line")
def _(d, mp):
    from mtkc.ir import model_checks

    m = tiny()
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("evil\x1b[2J", "1")):
        e = w.external_data.add()
        e.key, e.value = k, v
    (d / "w.bin").write_bytes(np.zeros(16, np.float32).tobytes())
    path = save(m, d / "m.onnx")
    assert model_checks  # the unknown key is warned about, escaped
    r = run_cli(["check", path, "--sdk", SDK])
    assert_contract(r, 0)
    _clean(r.err)
    assert "unknown external_data keys" in r.err


# ------------------------------------------------------------------ class 6: invalid ONNX


def _invalid(build: Callable[[], onnx.ModelProto], says: str, files: dict[str, bytes] | None = None):
    def run(d, mp):
        import mtkc.ir.model as model_io

        for name, data in (files or {}).items():
            (d / name).write_bytes(data)
        path = save(build(), d / "m.onnx")

        def no_weights(*args, **kwargs):
            raise AssertionError("a weight was read")

        mp.setattr(model_io, "_read_external", no_weights)
        mp.setattr(model_io, "read_values", no_weights)
        assert_contract(run_cli(["check", path, "--sdk", SDK]), 2, says)

    return run


def _dup_init():
    m = tiny()
    m.graph.initializer.append(m.graph.initializer[0])
    return m


def _node(op, inputs, outputs=("y",), opset=17, **attrs):
    def build():
        return make_model([helper.make_node(op, list(inputs), list(outputs), name="bad", **attrs)],
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 4]) for o in outputs], opset=opset)

    return build


def _external(entries: list[tuple[str, str]]):
    def build():
        m = tiny()
        w = m.graph.initializer[0]
        w.ClearField("raw_data")
        w.data_location = TensorProto.EXTERNAL
        for k, v in entries:
            e = w.external_data.add()
            e.key, e.value = k, v
        return m

    return build


def _undefined_input():
    """elem_type set to 0 explicitly passes the checker; onnxruntime's symbolic inference cycled on it."""
    m = tiny()
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    return m


W_BIN = {"w.bin": np.zeros(16, np.float32).tobytes()}
INVALID = {
    "input-elem-type-undefined": (_undefined_input, "graph input 'x' has element type UNDEFINED (0)", None),
    "duplicate-initializer": (_dup_init, "initializer name is not unique", None),
    "cast-without-to": (_node("Cast", ["x"]), "Required attribute 'to'", None),
    "concat-without-axis": (_node("Concat", ["x", "x"]), "Required attribute 'axis'", None),
    "transpose-perm-string": (_node("Transpose", ["x"], perm="01"), "Mismatched attribute type", None),
    "relu-two-inputs": (_node("Relu", ["x", "x"]), "invalid ONNX", None),
    "add-one-input": (_node("Add", ["x"]), "invalid ONNX", None),
    "unknown-attribute": (_node("Relu", ["x"], colour=3), "Unrecognized attribute", None),
    "opset-1": (_node("Relu", ["x"], opset=1), "opset 1 cannot be run", None),
    "opset-5": (_node("Relu", ["x"], opset=5), "opset 5 cannot be run", None),
    "opset-9999": (_node("Relu", ["x"], opset=9999), "opset 9999 cannot be run", None),
    "external-duplicate-location": (_external([("location", "w.bin"), ("location", "other.bin")]), "given twice", W_BIN),
    "external-duplicate-offset": (_external([("location", "w.bin"), ("offset", "0"), ("offset", "4")]), "given twice", W_BIN),
    "external-basepath": (_external([("location", "w.bin"), ("basepath", "/tmp")]), "basepath", W_BIN),
    "external-trailing-slash": (_external([("location", "w.bin/")]), "names no file", W_BIN),
    "external-trailing-backslash": (_external([("location", "w.bin\\")]), "names no file", W_BIN),
    "external-no-location": (_external([("offset", "0")]), "no location", W_BIN),
}
for _name, (_build, _says, _files) in INVALID.items():
    case("6", f"invalid-{_name}")(_invalid(_build, _says, _files))


# ------------------------------------------------------------------ class 8: the converter hand-off


def _converter(d: Path, body: str) -> str:
    script = d / "conv.py"
    script.write_text("import sys, os, time\n" + textwrap.dedent(body))
    return f"{sys.executable} {script} {{input}} {{output}}"


def _converter_case(body: str, code: int, says: str, *extra, check: Callable[[Path], None] | None = None):
    def run(d, mp):
        model = save(with_cpu_node("hm"), d / "m.onnx")
        r = run_cli(["compile", model, "--sdk", SDK, "-o", d / "out", "--converter-cmd", _converter(d, body), *extra])
        assert_contract(r, code, says)
        if check:
            check(d)

    return run


def _no_staging(d: Path) -> None:
    assert not [p for p in d.iterdir() if ".mtkc-" in p.name]


def _log_bounded(d: Path) -> None:
    log = next((d / "out" / "logs").glob("*.log")).read_text()
    assert len(log) < 200_000 and "bytes of converter output omitted" in log and log.rstrip().endswith("exit code: 0")


CONVERTERS = {
    "timeout": ("time.sleep(60)\n", 3, "ran past --converter-timeout 1 s", ("--converter-timeout", "1"),
                lambda d: (d / "out" / "logs").is_dir()),
    "exits-0-writes-nothing": ("pass\n", 3, "the converter is broken, not a node: on partition model/npu",
                               (), None),
    "fails-on-everything": ("sys.exit(1)\n", 3, "also fails on a trivial one-node graph", (), None),
    "huge-output-is-bounded": ("sys.stdout.write('x' * 5_000_000)\nopen(sys.argv[2], 'w').write('ok')\n", 0, None, (),
                               _log_bounded),
    "binary-output": ("sys.stdout.buffer.write(bytes(range(256)) * 100)\nopen(sys.argv[2], 'w').write('ok')\n", 0, None, (),
                      None),
    "fails-naming-the-node": ("if b'relu' in open(sys.argv[1], 'rb').read():\n    print('ERROR: node relu is not supported')\n"
                              "    sys.exit(1)\nopen(sys.argv[2], 'w').write('ok')\n", 3, "at node 'relu'", (), None),
    "leaves-a-background-child": ("import subprocess\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                                  "open(sys.argv[2], 'w').write('ok')\n", 0, None, (), None),
    "killed-by-signal": ("os.kill(os.getpid(), 9)\n", 3, "converter", (), None),
}
for _name, (_body, _code, _says, _extra, _check) in CONVERTERS.items():
    case("8", f"converter-{_name}")(_converter_case(_body, _code, _says, *_extra, check=_check))


@case("8", "bad-timeout-value")
def _(d, mp):
    model = save(tiny(), d / "m.onnx")
    for value in ("0", "-1", "nan", "inf"):
        assert_contract(run_cli(compile_args(model, d / "out", "--converter-timeout", value)), 2, "--converter-timeout")


# ------------------------------------------------------------------ class 9: paths a manifest names


def _escape_path(set_path: Callable[[dict, str], dict], target: Callable[[Path, Path], str], says: str):
    def run(d, mp, base):
        out = d / "out"
        shutil.copytree(base, out)
        victim = d / "victim"
        victim.mkdir()
        shutil.copy(out / "model.onnx", victim / "model.onnx")
        shutil.copy(out / "weights.bin", victim / "weights.bin")
        path = target(out, victim)
        _edit_manifest(lambda m: set_path(m, path))(out)
        opened = []
        real_load = onnx.load

        def spy(f, *a, **k):
            opened.append(str(f))
            return real_load(f, *a, **k)

        mp.setattr(onnx, "load", spy)
        assert_contract(run_cli(["verify", out]), 2, says)
        assert not any("victim" in p for p in opened)  # nothing outside OUT was opened

    run.needs_base = True
    return run


def _set_graph(m, p):
    return {**m, "graphs": [{**m["graphs"][0], "path": p}]}


def _set_part(m, p):
    g = m["graphs"][0]
    return {**m, "graphs": [{**g, "partitions": [{**g["partitions"][0], "path": p}] + g["partitions"][1:]}]}


def _set_host(m, p):
    return {**m, "host": {"embedding": {"path": p, "dtype": "float32", "shape": [1]}}}


def _link(name: str, to: str):
    def target(out: Path, victim: Path) -> str:
        (out / name).symlink_to(victim / to if to else victim)
        return name if to else f"{name}/model.onnx"

    return target


ESCAPES = {
    "dotdot": lambda out, victim: "../victim/model.onnx",
    "deep-dotdot": lambda out, victim: "sub/../../victim/model.onnx",
    "absolute": lambda out, victim: str(victim / "model.onnx"),
    "backslash-dotdot": lambda out, victim: "..\\victim\\model.onnx",
    "symlink-file": _link("evil.onnx", "model.onnx"),
    "symlink-folder": _link("evil", ""),
    "nul-byte": lambda out, victim: "model.onnx\0../victim",
    "empty": lambda out, victim: "",
    "a-folder": lambda out, victim: (os.mkdir(out / "dir"), "dir")[1],
}
for _name, _target in ESCAPES.items():
    _says = "is missing" if _name == "a-folder" else "path"
    case("9", f"confine-graph-{_name}")(_escape_path(_set_graph, _target, _says))
    if _name in ("dotdot", "absolute", "symlink-file", "symlink-folder"):
        case("9", f"confine-partition-{_name}")(_escape_path(_set_part, _target, _says))
        case("9", f"confine-host-{_name}")(_escape_path(_set_host, _target, _says))


@case("9", "confine-external-data-of-a-graph")
def _(d, mp, base):
    out = d / "out"
    shutil.copytree(base, out)
    (d / "secret.bin").write_bytes(b"\1" * 4096)
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert proto.graph.initializer
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../secret.bin"
    (out / "model.onnx").write_bytes(proto.SerializeToString())
    assert_contract(run_cli(["verify", out]), 2, "escapes the model folder")


# ------------------------------------------------------------------ class 10: plugins


PLUGINS = {
    "exit-0-at-import": ("import sys\nsys.exit(0)\n", "failed to import: SystemExit: 0"),
    "exit-1-at-import": ("import sys\nsys.exit(1)\n", "failed to import: SystemExit: 1"),
    "exit-text-at-import": ("raise SystemExit('bye')\n", "failed to import: SystemExit: bye"),
    "exit-0-in-run": (None, "raised in run: SystemExit: 0"),
    "exit-in-applies": (None, "raised in applies: SystemExit"),
    "exit-in-init": (None, "raised in create: SystemExit"),
}
_HOOK = {"exit-0-in-run": ("run", "sys.exit(0)"), "exit-in-applies": ("applies", "sys.exit(3)"),
         "exit-in-init": ("__init__", "sys.exit(4)")}
for _name, (_source, _says) in PLUGINS.items():
    def _plugin_case(d, mp, name=_name, source=_source, says=_says):
        stem = "pl_" + name.replace("-", "_")
        if source is None:
            hook, stmt = _HOOK[name]
            args = {"run": "self, graph, ctx", "applies": "self, ctx", "__init__": "self"}[hook]
            source = textwrap.dedent(f"""\
                import sys
                from mtkc.rewrite.pass_api import Pass, PassResult, register

                @register
                class P(Pass):
                    name = "{stem.replace('_', '-')}"
                    description = "exits"

                    def {hook}({args}):
                        {stmt}
                        return PassResult()
                """)
        plugin = d / f"{stem}.py"
        plugin.write_text(source)
        model = save(tiny(), d / "m.onnx")
        assert_contract(run_cli(compile_args(model, d / "out", "--plugin", plugin)), 2, says)
        assert not (d / "out").exists()

    case("10", f"plugin-{_name}")(_plugin_case)


# ------------------------------------------------------------------ the runner


@pytest.fixture(scope="session")
def arena(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-arena")
    (root / "victim").mkdir()
    (root / "victim" / "secret.txt").write_text("do not touch")
    return root


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(name, arena, monkeypatch, request):
    cls, fn = CASES[name]
    folder = arena / name
    folder.mkdir()
    extra = (request.getfixturevalue("base_out"),) if getattr(fn, "needs_base", False) or \
        fn.__code__.co_varnames[:fn.__code__.co_argcount][-1:] == ("base",) else ()
    before = snapshot(arena, skip=folder)
    fn(folder, monkeypatch, *extra)
    monkeypatch.undo()
    assert snapshot(arena, skip=folder) == before  # nothing outside the case folder changed


def test_corpus_covers_every_class():
    per_class: dict[str, int] = {}
    for cls, _ in CASES.values():
        per_class[cls] = per_class.get(cls, 0) + 1
    assert set(per_class) == {"1", "2", "3", "4", "5", "6", "8", "9", "10"}
    assert sum(per_class.values()) >= 150
