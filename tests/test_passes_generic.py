"""Generic passes on real tiny exports (numerics in onnxruntime) and on small hand-built graphs."""

from __future__ import annotations

import collections
import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from mtkc.errors import InputError
from mtkc.ir import execute, shapes
from mtkc.ir.counts import COUNTS
from mtkc.ir import model as mtkc_model
from mtkc.passes import bind_shapes, cleanup, fold, int32, legalize, opset17, rank4  # noqa: F401 (registers)
from mtkc.rewrite.pass_api import Context

PIPELINE = [bind_shapes.BindShapes, fold.Fold, cleanup.Cleanup, opset17.Opset17, int32.Int64ToInt32,
            rank4.Rank4, legalize.Legalize]
SEQ, CACHE = 16, 8
EXPORTS = [("legacy17", False), ("legacy17", True), ("legacy14", False), ("dynamo", False), ("dynamo", True),
           ("hf", False), ("hf", True)]


def _ctx(model, **options):
    return Context(table=None, options=options, root=model.root, read_values=model.values)


def _feeds(graph, pad: int = 0):
    feeds = execute.seeded_inputs(graph, seed=0)
    for name, v in feeds.items():
        if "attention_mask" in name and pad:
            v[:, :pad] = 0
    return feeds


def run_pipeline(path, passes=PIPELINE, **options):
    model = mtkc_model.load(path)
    ctx = _ctx(model, **options)
    results = {}
    instances = {}
    for cls in passes:
        p = cls()
        results[p.name] = p.run(model.graph, ctx)
        instances[p.name] = p
        model.graph.cleanup().toposort()
        again = cls().run(model.graph, ctx)
        assert again.rewrites == 0, f"{p.name} is not idempotent: {again}"
        model.graph.cleanup().toposort()
        if p.name == "bind-shapes":
            feeds = _feeds(model.graph)
    return model, ctx, results, instances, feeds


def _compare(path, model, feeds, instances, atol=1e-4):
    reference = mtkc_model.load(path)
    expected = execute.run(reference.graph, feeds, reference.root)
    for p in instances.values():
        feeds = p.map_feeds(feeds, None)
    actual = execute.run(model.graph, feeds, model.root)
    for out in reference.graph.outputs:
        np.testing.assert_allclose(actual[out.name], expected[out.name], atol=atol, rtol=1e-4, err_msg=out.name)


@pytest.mark.parametrize("exporter,cache", EXPORTS)
def test_pipeline_keeps_logits_and_leaves_no_int64_shape_maths_or_rank5(exported, exporter, cache):
    path = exported("qwen2", exporter, cache)
    model, ctx, results, instances, feeds = run_pipeline(path, seq_len=SEQ, cache_len=CACHE)
    _compare(path, model, feeds, instances)
    graph = model.graph
    assert graph.opset == 17
    ops = collections.Counter(n.op for n in graph.nodes)
    assert ops["Shape"] == ops["Range"] == ops["ConstantOfShape"] == 0, ops
    assert [t.name for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.dtype == np.int64] == []
    assert all(len(t.shape) == 2 and t.dtype == np.int32 for t in graph.inputs if "ids" in t.name or "mask" in t.name)
    high = [t for t in graph.tensors().values() if t.shape is not None and len(t.shape) > 4]
    assert len(high) <= 1, [t.name for t in high]  # at most the padding-mask gather indices (mask pass)


def _layer(node: gs.Node) -> int | None:
    m = re.search(r"layers\.(\d+)", node.name)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("exporter,budget", [("legacy17", 66), ("legacy14", 66)])
def test_torchscript_layer_shrinks_from_236_nodes(exported, exporter, budget):
    path = exported("qwen2", exporter, False)
    before = collections.Counter(_layer(n) for n in mtkc_model.load(path).graph.nodes)
    model, *_ = run_pipeline(path, seq_len=SEQ)
    after = collections.Counter(_layer(n) for n in model.graph.nodes)
    assert before[1] >= 230
    assert after[1] <= budget, after


def test_left_padding_still_matches(exported):
    path = exported("qwen2", "legacy17", False)
    model, ctx, results, instances, feeds = run_pipeline(path, seq_len=SEQ)
    feeds = _feeds(model.graph, pad=3)
    feeds = {k: v.astype(np.int64) for k, v in feeds.items()}
    _compare(path, model, feeds, instances)


def test_cache_len_on_a_no_cache_export_is_ignored(exported):
    """--cache-len with a no-cache model: the mask input stays [1,1,T,T] (was T+C: int64-to-int32 failed)."""
    from mtkc.manager.pass_manager import resolve_pipeline
    from mtkc.pipeline.registry import load_registry
    from mtkc.manager.pass_manager import run_pipeline as run_passes
    from mtkc.target.capability import load_table

    path = exported("llama", "legacy14", False)
    model = mtkc_model.load(path)
    ctx = Context(load_table("6.0"), {"seq_len": 8, "cache_len": 16}, model.root, model.values)
    pipeline = resolve_pipeline(load_registry(), ctx, None)
    feeds = {"input_ids": np.arange(3, 11, dtype=np.int64)[None], "attention_mask": np.ones((1, 8), np.int64)}
    feeds.update({t.name: np.arange(8, dtype=np.int64)[None] for t in model.graph.inputs if t.name == "position_ids"})
    expected = execute.run(mtkc_model.load(path).graph, feeds, model.root)
    run_passes(model.graph, pipeline, ctx)
    assert {t.name: list(t.shape) for t in model.graph.inputs}["attention_mask"] == [1, 1, 8, 8]
    for p in pipeline.passes:
        feeds = p.map_feeds(feeds, ctx)
    actual = execute.run(model.graph, {t.name: feeds[t.name] for t in model.graph.inputs}, model.root)
    name = model.graph.outputs[0].name
    np.testing.assert_allclose(actual[name], expected[name], atol=1e-4, rtol=1e-4)


# --- bind-shapes ------------------------------------------------------------------------------


def test_bind_shapes_roles_and_symbols(exported):
    model = mtkc_model.load(exported("qwen2", "legacy17", True))
    result = bind_shapes.BindShapes().run(model.graph, _ctx(model, seq_len=5, cache_len=11))
    dims = {t.name: list(t.shape) for t in model.graph.inputs}
    assert dims["input_ids"] == [1, 5] and dims["attention_mask"] == [1, 16]
    assert dims["past_key_values.0.key"] == [1, 2, 11, 16]
    assert {t.name: list(t.shape) for t in model.graph.outputs}["present.0.key"] == [1, 2, 16, 16]
    assert result.misses == []


def test_bind_shapes_refuses_unbound_cache_and_conflicts(exported):
    model = mtkc_model.load(exported("qwen2", "legacy17", True))
    result = bind_shapes.BindShapes().run(model.graph, _ctx(model, seq_len=4))
    assert any(m.node == "past_key_values.0.key" and "--cache-len" in m.reason for m in result.misses)
    model = mtkc_model.load(exported("qwen2", "legacy17", False))
    with pytest.raises(InputError, match="input_ids"):
        bind_shapes.BindShapes().run(model.graph, _ctx(model, input_shapes={"input_ids": (1, 4, 2)}))


def test_bind_shapes_evaluates_hf_symbols_and_numeric_strings(tmp_path):
    x = gs.Variable("past_key_values.layers.0.keys", np.float32, ["s44", "2", "s85", "16"])
    ids = gs.Variable("input_ids", np.int64, ["s44", "s70"])
    out = gs.Variable("present", np.float32, ["s44", 2, "s70 + s85", 16])
    graph = gs.Graph(nodes=[gs.Node("Identity", inputs=[x], outputs=[out])], inputs=[ids, x], outputs=[out], opset=17)
    bind_shapes.BindShapes().run(graph, Context(table=None, options={"seq_len": 3, "cache_len": 7}))
    assert list(x.shape) == [1, 2, 7, 16] and list(ids.shape) == [1, 3]


def test_shapes_infer_falls_back_to_symbolic_inference(tmp_path, monkeypatch):
    """ONNX has no schema for com.microsoft ops: onnxruntime's symbolic inference types what follows."""
    monkeypatch.chdir(tmp_path)
    x = gs.Variable("x", np.float32, [2, 4])
    gamma = gs.Constant("gamma", np.ones(4, np.float32))
    y, z = gs.Variable("y"), gs.Variable("z")
    odd = gs.Variable("odd")  # an op nobody knows: inference stops there, nothing is written to the cwd
    nodes = [gs.Node("SimplifiedLayerNormalization", domain="com.microsoft", attrs={"axis": -1, "epsilon": 1e-6},
                     inputs=[x, gamma], outputs=[y]),
             gs.Node("Relu", inputs=[y], outputs=[z]),
             gs.Node("Mystery", domain="com.example", inputs=[z], outputs=[odd])]
    graph = _graph(nodes, [x], [z, odd])
    shapes.infer(graph)
    assert (list(y.shape), list(z.shape), y.dtype, odd.shape) == ([2, 4], [2, 4], np.float32, None)
    assert list(tmp_path.iterdir()) == []


# --- fold -------------------------------------------------------------------------------------


def _graph(nodes, inputs, outputs, opset=17):
    return gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, opset=opset)


def test_fold_keeps_big_transpose_of_a_lazy_weight(monkeypatch):
    """The tied lm_head case: Transpose(W) of a weight still on disk is not read nor stored twice."""
    monkeypatch.setattr(fold, "FOLD_MAX_ELEMENTS", 8)
    w = gs.Constant("w", gs.ir.tensor.LazyValues(onnx.numpy_helper.from_array(np.ones((3, 4), np.float32), "w")))
    x = gs.Variable("x", np.float32, [4, 3])
    wt, y = gs.Variable("wt"), gs.Variable("y", np.float32)
    nodes = [gs.Node("Transpose", name="lm_head_t", attrs={"perm": [1, 0]}, inputs=[w], outputs=[wt]),
             gs.Node("Add", inputs=[x, wt], outputs=[y])]
    graph = _graph(nodes, [x], [y])
    shapes.infer(graph)
    result = fold.Fold().run(graph, Context(table=None))
    assert [n.op for n in graph.nodes] == ["Transpose", "Add"]
    assert [m.reason for m in result.misses if m.node == "lm_head_t"] == [
        "Transpose of weight 'w' (12 elements) kept: folding would read it and store it twice"]


def test_fold_size_policy(monkeypatch):
    monkeypatch.setattr(fold, "FOLD_MAX_ELEMENTS", 8)
    w = gs.Constant("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    x = gs.Variable("x", np.float32, [4, 3])
    wt, big, y = gs.Variable("wt"), gs.Variable("big"), gs.Variable("y", np.float32)
    shape = gs.Constant("shape", np.array([5, 3, 4], np.int64))
    nodes = [gs.Node("Transpose", attrs={"perm": [1, 0]}, inputs=[w], outputs=[wt]),
             gs.Node("Expand", inputs=[w, shape], outputs=[big]),
             gs.Node("Add", inputs=[x, wt], outputs=[y])]
    graph = _graph(nodes, [x], [y, big])
    shapes.infer(graph)
    result = fold.Fold().run(graph, Context(table=None))
    assert [n.op for n in graph.nodes] == ["Expand", "Add"]  # relayout folded, growth refused
    assert any("graph output" in m.reason or "elements" in m.reason for m in result.misses)
    np.testing.assert_array_equal(graph.nodes[1].inputs[1].values, np.arange(12, dtype=np.float32).reshape(3, 4).T)


def test_fold_shape_chain_to_constant_reshape():
    x = gs.Variable("x", np.float32, [2, 3, 4])
    s, d, u, shp, y = (gs.Variable(n) for n in ("s", "d", "u", "shp", "y"))
    nodes = [gs.Node("Shape", inputs=[x], outputs=[s]),
             gs.Node("Gather", attrs={"axis": 0}, inputs=[s, gs.Constant("i", np.array(0, np.int64))], outputs=[d]),
             gs.Node("Unsqueeze", inputs=[d, gs.Constant("ax", np.array([0], np.int64))], outputs=[u]),
             gs.Node("Concat", attrs={"axis": 0}, inputs=[u, gs.Constant("m1", np.array([-1], np.int64))], outputs=[shp]),
             gs.Node("Reshape", inputs=[x, shp], outputs=[y])]
    graph = _graph(nodes, [x], [y])
    shapes.infer(graph)
    COUNTS.clear()
    result = fold.Fold().run(graph, Context(table=None))
    graph.cleanup()
    assert [n.op for n in graph.nodes] == ["Reshape"] and result.rewrites == 4
    assert list(graph.nodes[0].inputs[1].values) == [2, -1] and list(y.shape) == [2, 12]
    assert COUNTS["sessions"] == 0  # shape operands: evaluated in numpy (mtkc.ir.shape_values)


def test_fold_evaluates_shape_operands_in_numpy_and_the_rest_in_one_session():
    """The shape chain folds without onnxruntime; the Range too long for `shape_values` (100 > 64
    elements) and the Cast reading it run in one session, on the chain's value; same numbers as
    onnxruntime on the unfolded graph."""
    x = gs.Variable("x", np.float32, [1, 100])
    s, d, r, f, y = (gs.Variable(n) for n in ("s", "d", "r", "f", "y"))
    nodes = [gs.Node("Shape", inputs=[x], outputs=[s]),
             gs.Node("Gather", attrs={"axis": 0}, inputs=[s, gs.Constant("i", np.array(1, np.int64))], outputs=[d]),
             gs.Node("Range", inputs=[gs.Constant("zero", np.array(0, np.int64)), d,
                                      gs.Constant("one", np.array(1, np.int64))], outputs=[r]),
             gs.Node("Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[r], outputs=[f]),
             gs.Node("Add", inputs=[x, f], outputs=[y])]
    graph = _graph(nodes, [x], [y])
    shapes.infer(graph)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 100)).astype(np.float32)}
    expected = execute.run(graph, feeds)["y"]
    COUNTS.clear()
    result = fold.Fold().run(graph, Context(table=None))
    graph.cleanup()
    assert [n.op for n in graph.nodes] == ["Add"] and result.rewrites == 4
    assert COUNTS["sessions"] == 1  # Range + Cast; Shape folds by shape, Gather in numpy
    np.testing.assert_array_equal(execute.run(graph, feeds)["y"], expected)


# --- cleanup ----------------------------------------------------------------------------------


def test_cleanup_noops_pairs_and_cse():
    x = gs.Variable("x", np.float32, [2, 3])
    t = [gs.Variable(f"t{i}") for i in range(8)]
    nodes = [gs.Node("Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[x], outputs=[t[0]]),
             gs.Node("Transpose", attrs={"perm": [1, 0]}, inputs=[t[0]], outputs=[t[1]]),
             gs.Node("Transpose", attrs={"perm": [1, 0]}, inputs=[t[1]], outputs=[t[2]]),
             gs.Node("Cast", attrs={"to": onnx.TensorProto.INT32}, inputs=[t[2]], outputs=[t[3]]),  # lossy: kept
             gs.Node("Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[t[3]], outputs=[t[4]]),
             gs.Node("Sigmoid", inputs=[t[4]], outputs=[t[5]]),
             gs.Node("Sigmoid", inputs=[t[4]], outputs=[t[6]]),
             gs.Node("Add", inputs=[t[5], t[6]], outputs=[t[7]])]
    graph = _graph(nodes, [x], [t[7]])
    shapes.infer(graph)
    feeds = {"x": np.array([[0.4, -1.6, 2.5], [3.7, 0.0, -0.2]], np.float32)}
    expected = execute.run(graph, feeds)["t7"]
    result = cleanup.Cleanup().run(graph, Context(table=None))
    assert [n.op for n in graph.nodes] == ["Cast", "Cast", "Sigmoid", "Add"]
    assert result.rewrites >= 4
    np.testing.assert_array_equal(execute.run(graph, feeds)["t7"], expected)
    assert cleanup.Cleanup().run(graph, Context(table=None)).rewrites == 0


def test_cleanup_dedupes_external_constants_without_reading():
    def external(name):
        proto = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=[4096])
        proto.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", "missing.bin"), ("offset", "0"), ("length", "16384")):
            proto.external_data.add(key=k, value=v)
        return gs.Constant(name, gs.ir.tensor.LazyValues(proto))

    x = gs.Variable("x", np.float32, [4096])
    a, b, y = gs.Variable("a", np.float32, [4096]), gs.Variable("b", np.float32, [4096]), gs.Variable("y", np.float32, [4096])
    graph = _graph([gs.Node("Mul", inputs=[x, external("w1")], outputs=[a]),
                    gs.Node("Mul", inputs=[x, external("w2")], outputs=[b]),
                    gs.Node("Add", inputs=[a, b], outputs=[y])], [x], [y])
    cleanup.Cleanup().run(graph, Context(table=None))  # the file does not exist: never read
    assert len(graph.nodes) == 2 and graph.nodes[-1].inputs[0] is graph.nodes[-1].inputs[1]


def test_cleanup_keeps_0d_and_1d_constants_with_equal_bytes_apart():
    """ortopt's Concat of Unsqueeze outputs and a [2]: merging it with a scalar 2 broke the Concat."""
    x = gs.Variable("x", np.int64, [])
    u, shape, y = gs.Variable("u", np.int64, [1]), gs.Variable("shape", np.int64, [2]), gs.Variable("y", np.int64, [])
    nodes = [gs.Node("Unsqueeze", inputs=[x, gs.Constant("axes", np.array([0]))], outputs=[u]),
             gs.Node("Concat", attrs={"axis": 0}, inputs=[u, gs.Constant("a_one_d", np.array([2]))], outputs=[shape]),
             gs.Node("ReduceSum", attrs={"keepdims": 0}, inputs=[shape], outputs=[y]),
             gs.Node("Add", inputs=[y, gs.Constant("a_scalar", np.array(2))], outputs=[gs.Variable("z", np.int64, [])])]
    graph = _graph(nodes, [x], [nodes[-1].outputs[0]])
    feeds = {"x": np.array(5, np.int64)}
    cleanup.Cleanup().run(graph, Context(table=None))
    assert graph.nodes[1].inputs[1].shape == (1,) and graph.nodes[3].inputs[1].shape == ()
    assert execute.run(graph, feeds)["z"] == 9


# --- int64-to-int32 ---------------------------------------------------------------------------


def test_int32_converts_inputs_clamps_slice_and_casts_shape():
    ids = gs.Variable("input_ids", np.int64, [1, 6])
    table = gs.Constant("table", np.arange(40, dtype=np.float32).reshape(10, 4))
    e, s, y, n, z = (gs.Variable(k) for k in ("e", "s", "y", "n", "z"))
    nodes = [gs.Node("Gather", inputs=[table, ids], outputs=[e]),
             gs.Node("Slice", inputs=[e, gs.Constant("st", np.array([2], np.int64)),
                                      gs.Constant("en", np.array([np.iinfo(np.int64).max], np.int64)),
                                      gs.Constant("ax", np.array([1], np.int64))], outputs=[s]),
             gs.Node("Shape", inputs=[ids], outputs=[n]),
             gs.Node("Add", inputs=[n, gs.Constant("one", np.array([1], np.int64))], outputs=[z]),
             gs.Node("Reshape", inputs=[s, gs.Constant("shp", np.array([4, 4], np.int64))], outputs=[y])]
    graph = _graph(nodes, [ids], [y, z])
    shapes.infer(graph)
    feeds = {"input_ids": np.array([[1, 2, 3, 9, 0, 5]], np.int64)}
    expected = execute.run(graph, feeds)
    p = int32.Int64ToInt32()
    result = p.run(graph, Context(table=None))
    assert ids.dtype == np.int32 and p.converted_inputs == ["input_ids"]
    assert [m.node for m in result.misses if "Shape" in m.reason] != []
    reshape = next(n for n in graph.nodes if n.op == "Reshape")
    assert reshape.inputs[1].dtype == np.int64  # Reshape.shape stays a static int64 operand
    assert z.dtype == np.int32 and p.converted_outputs == ["z"]
    actual = execute.run(graph, p.map_feeds(feeds, None))
    np.testing.assert_array_equal(actual["y"], expected["y"])
    np.testing.assert_array_equal(actual["z"], expected["z"])
    assert int32.Int64ToInt32().run(graph, Context(table=None)).rewrites == 0


@pytest.mark.parametrize("exporter,cache", EXPORTS + [("optimum", True), ("genai-fp32", True)])
def test_int32_retypes_downstream_as_whole_graph_inference_does(exported, exporter, cache, monkeypatch):
    """int64-to-int32 on a settled graph re-infers only downstream of its edits (`shapes.retype`):
    every tensor's dtype and shape is what ONNX's inference of the whole graph gives. (The genai
    export is not settled after these four passes: it takes the whole inference both times.)"""
    model = mtkc_model.load(exported("qwen2", exporter, cache))
    graphs = {}
    for whole in (False, True):
        graph = model.copy().graph
        ctx = _ctx(model, seq_len=SEQ, cache_len=CACHE)
        for cls in PIPELINE[:4]:
            cls().run(graph, ctx)
            graph.cleanup().toposort()
        settled = shapes.settled(graph)
        assert settled or exporter == "genai-fp32"
        if whole:
            monkeypatch.setattr(shapes, "retype", lambda graph, changed: False)
        COUNTS.clear()
        int32.Int64ToInt32().run(graph, ctx)
        assert (COUNTS["retypes"], COUNTS["shape inferences"]) == ((0, 1) if whole or not settled else (1, 0))
        graphs[whole] = graph
    typed = [{n: (str(t.dtype), t.shape) for n, t in g.tensors().items()} for g in graphs.values()]
    assert typed[0] == typed[1]
    assert gs.export_onnx(graphs[False]).SerializeToString() == gs.export_onnx(graphs[True]).SerializeToString()


# --- opset17 ----------------------------------------------------------------------------------


def test_opset17_lowers_opset18_forms():
    x = gs.Variable("x", np.float32, [2, 6])
    a, b, m, r, y = (gs.Variable(k) for k in ("a", "b", "m", "r", "y"))
    nodes = [gs.Node("Split", attrs={"axis": 1, "num_outputs": 2}, inputs=[x], outputs=[a, b]),
             gs.Node("ReduceMean", attrs={"keepdims": 1}, inputs=[a, gs.Constant("axes", np.array([-1], np.int64))], outputs=[m]),
             gs.Node("Reshape", attrs={"allowzero": 1}, inputs=[b, gs.Constant("s", np.array([3, 2, 1], np.int64))], outputs=[r]),
             gs.Node("Add", inputs=[r, m], outputs=[y])]
    graph = _graph(nodes, [x], [y], opset=18)
    graph.import_domains = [onnx.helper.make_opsetid("", 18)]
    shapes.infer(graph)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)}
    expected = execute.run(graph, feeds)["y"]
    result = opset17.Opset17().run(graph, Context(table=None))
    assert graph.opset == 17 and result.rewrites == 4 and result.misses == []
    assert gs.export_onnx(graph).opset_import[0].version == 17
    np.testing.assert_allclose(execute.run(graph, feeds)["y"], expected, rtol=1e-6)


def test_opset17_leaves_the_parsed_file_alone():
    """A second graph imported from the same parsed proto (compile's prefill then decode) is still opset 20."""
    x, y = gs.Variable("x", np.float32, [2, 3]), gs.Variable("y", np.float32, [3, 2])
    shape = gs.Constant("shape", np.array([3, 2], np.int64))
    proto = gs.export_onnx(_graph([gs.Node("Reshape", attrs={"allowzero": 1}, inputs=[x, shape], outputs=[y])], [x], [y], 20))
    first = gs.import_onnx(proto)
    assert opset17.Opset17().run(first, Context(table=None)).rewrites == 2 and first.opset == 17
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 20)]
    second = gs.import_onnx(proto)
    assert second.opset == 20 and opset17.Opset17().run(second, Context(table=None)).rewrites == 2


def test_opset17_refuses_ops_without_a_17_form():
    x, y = gs.Variable("x", np.float32, [2]), gs.Variable("y", np.float32, [2])
    graph = _graph([gs.Node("Gelu", name="g", inputs=[x], outputs=[y])], [x], [y], opset=20)
    result = opset17.Opset17().run(graph, Context(table=None))
    assert graph.opset == 20 and result.misses[0].node == "g"


# --- rank4 / legalize -------------------------------------------------------------------------


def test_rank4_rewrites_repeat_kv():
    k = gs.Variable("k", np.float32, [1, 2, 5, 4])
    u, e, y = gs.Variable("u", np.float32, [1, 2, 1, 5, 4]), gs.Variable("e", np.float32, [1, 2, 3, 5, 4]), gs.Variable("y", np.float32, [1, 6, 5, 4])
    nodes = [gs.Node("Unsqueeze", inputs=[k, gs.Constant("ax", np.array([2], np.int64))], outputs=[u]),
             gs.Node("Expand", inputs=[u, gs.Constant("sh", np.array([1, 2, 3, 5, 4], np.int64))], outputs=[e]),
             gs.Node("Reshape", inputs=[e, gs.Constant("rs", np.array([1, 6, 5, 4], np.int64))], outputs=[y])]
    graph = _graph(nodes, [k], [y])
    feeds = {"k": np.random.default_rng(1).standard_normal((1, 2, 5, 4)).astype(np.float32)}
    expected = execute.run(graph, feeds)["y"]
    assert rank4.Rank4().run(graph, Context(table=None)).rewrites == 1
    assert list(e.shape) == [1, 2, 3, 20] and [n.op for n in graph.nodes] == ["Reshape", "Expand", "Reshape"]
    np.testing.assert_array_equal(execute.run(graph, feeds)["y"], expected)


def test_legalize_neg_pow_broadcast_gemm():
    a = gs.Variable("a", np.float32, [3, 4])
    w, bias = gs.Constant("w", np.ones((4, 5), np.float32)), gs.Constant("b", np.arange(5, dtype=np.float32))
    t = [gs.Variable(f"t{i}") for i in range(5)]
    nodes = [gs.Node("Neg", inputs=[a], outputs=[t[0]]),
             gs.Node("Pow", inputs=[t[0], gs.Constant("two", np.array(2.0, np.float32))], outputs=[t[1]]),
             gs.Node("MatMul", inputs=[t[1], w], outputs=[t[2]]),
             gs.Node("Add", inputs=[t[2], bias], outputs=[t[3]]),
             gs.Node("Mul", inputs=[t[3], gs.Constant("s", np.array([2.0], np.float32))], outputs=[t[4]])]
    graph = _graph(nodes, [a], [t[4]])
    shapes.infer(graph)
    feeds = {"a": np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)}
    expected = execute.run(graph, feeds)["t4"]
    legalize.Legalize().run(graph, Context(table=None))
    graph.cleanup().toposort()
    assert [n.op for n in graph.nodes] == ["Mul", "Mul", "Gemm", "Mul"]
    assert all(len(x.shape) == 2 for n in graph.nodes if n.op == "Mul" for x in n.inputs)
    np.testing.assert_allclose(execute.run(graph, feeds)["t4"], expected, rtol=1e-6)
    assert legalize.Legalize().run(graph, Context(table=None)).rewrites == 0


def test_symbolic_shape_inference_stops_on_a_graph_it_cycles_on():
    """onnxruntime's symbolic inference repeats while a merge changes a dim; on an input typed
    UNDEFINED it never stops. mtkc runs it at most SYMBOLIC_ROUNDS times (it hung before)."""
    import signal

    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.UNDEFINED, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)],
        [onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def hung(signum, frame):
        raise TimeoutError("symbolic shape inference did not stop")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        inferred = shapes._symbolic_infer(proto)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    m = next(vi for vi in inferred.graph.value_info if vi.name == "m")
    assert [d.dim_value for d in m.type.tensor_type.shape.dim] == [1, 4]  # what it typed before it stopped
