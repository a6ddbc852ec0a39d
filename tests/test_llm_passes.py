"""LLM block passes (rmsnorm, rope, swiglu, attention, mask, embedding) and the pattern matcher.

Site counts per exporter on the raw tiny exports (L = 2 layers): RMSNorm 2L+1, RoPE 2L (q and k
of every layer), SwiGLU L, attention L. Then the full default pipeline per SDK: no Sin, Cos,
Range, Where, bool or int64 runtime tensor, no RMSNormalization / RotaryEmbedding / fused
attention / FusedMatMul, SDK 8 keeps the native SimplifiedLayerNormalization, and logits match the original
within 1e-4 when the normalised inputs (mask, pos_emb, hidden_states) are built from the
original inputs by each pass's `map_feeds`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from mtkc.ir.execute import run
from mtkc.ir.model import load
from mtkc.manager.pass_manager import resolve_pipeline, run_pipeline
from mtkc.pipeline.registry import load_registry
from mtkc.passes import attention, attention_fused, embedding, mask, rmsnorm, rope, rope_fused, swiglu
from mtkc.rewrite.pass_api import Context
from mtkc.rewrite.pattern import Const, Op, Or, Var, match, near
from mtkc.rewrite.rules import find
from mtkc.target.capability import load_table

LAYERS = 2
T, C = 3, 4
FUSED = {"RMSNormalization", "RotaryEmbedding", "Attention", "MultiHeadAttention", "GroupQueryAttention",
         "SkipSimplifiedLayerNormalization", "FusedMatMul"}
FORBIDDEN = {"Sin", "Cos", "Range", "Where", "IsNaN", "Neg", "GatherND"} | FUSED
EXPORTS = [("qwen2", e, cache) for e in ("legacy14", "legacy17", "dynamo", "hf", "hf-ortfused", "dynamo-ortfused", "ortopt")
           for cache in (False, True)] \
    + [("llama", "legacy17", True), ("llama", "dynamo", False), ("llama", "hf", True), ("llama", "hf-ortfused", True),
       ("llama", "ortopt", True)]

PIPELINE_EXPORTS = EXPORTS


def _ctx(sdk="6.0", model=None, **options):
    table = load_table(sdk) if sdk else None
    return Context(table, options, model.root if model else None, model.values if model else None)


def _feeds(graph: gs.Graph, cache: bool, pad: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """input_ids [1,T], 2-D mask [1,C+T] (first key padded when `pad`), positions C..C+T-1, past [1,kv,C,D]."""
    rng = np.random.default_rng(seed)
    past = C if cache else 0
    feeds = {}
    for t in graph.inputs:
        if t.name == "input_ids":
            feeds[t.name] = rng.integers(3, 1000, (1, T)).astype(np.int64)
        elif t.name == "attention_mask":
            feeds[t.name] = np.ones((1, past + T), np.int64)
            feeds[t.name][0, 0] = 0 if pad else 1
        elif t.name == "position_ids":
            feeds[t.name] = np.arange(past, past + T, dtype=np.int64)[None]
        else:  # past key / value [batch, kv heads, past, head_dim]
            feeds[t.name] = rng.standard_normal((1, int(t.shape[1]), past, int(t.shape[3]))).astype(np.float32)
    return feeds


def _ops(graph: gs.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in graph.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return counts


# -- pattern matcher ----------------------------------------------------------------------------
def _tiny_graph():
    x = gs.Variable("x", np.float32, [2, 4])
    two = gs.Constant("two", np.array(2.0, np.float32))
    sq = gs.Variable("sq", np.float32)
    out = gs.Variable("out", np.float32)
    nodes = [gs.Node("Pow", "pow", inputs=[x, two], outputs=[sq]),
             gs.Node("Mul", "mul", inputs=[sq, x], outputs=[out])]
    return gs.Graph(nodes, [x], [out]), x, out


def test_pattern_alternatives_commutation_and_bindings():
    graph, x, out = _tiny_graph()
    square = Or(Op("Mul", Var("x"), Var("x")), Op("Pow", Var("x"), Const("e", value=2.0)))
    m = match(Op("Mul", Var("x"), square, name="outer"), out)
    assert m.ok and m["x"] is x and m["outer"].name == "mul" and float(m.value("e")) == 2.0
    assert [n.name for n in m.nodes] == ["mul", "pow"]  # Mul inputs were matched swapped


def test_pattern_reports_the_deepest_failure():
    graph, x, out = _tiny_graph()
    m = match(Op("Mul", Op("Pow", Var("x"), Const(value=3.0)), Var("x")), out)
    assert not m.ok and m.reason == "constant two is [2.0], expected 3.0" and m.node == "pow"
    m = match(Op("Mul", Op("Sqrt", Var("x")), Var("x")), out)
    assert m.reason == "expected Sqrt, found Pow" and m.node == "pow"
    m = match(Op("Mul", Op("Pow", Var("y"), Const()), Var("x")), out)
    assert m.ok and m["y"] is x  # two names may bind one tensor; one name never binds two


def test_near_finds_the_root_downstream_of_an_anchor():
    graph, x, out = _tiny_graph()
    pow_node = graph.nodes[0]
    assert near(Op("Mul", Op("Pow", Var("x"), Const()), Var("x")), pow_node, "Mul", steps=2).ok
    miss = near(Op("Add", Var("a"), Var("b")), pow_node, "Add", steps=2)
    assert not miss.ok and miss.reason == "no Add within 2 steps after Pow pow"


# -- site counts on the raw exports --------------------------------------------------------------
def _fused(graph, ops):
    return sum(1 for n in graph.nodes if n.op in ops)


@pytest.mark.parametrize("family,exporter,cache", EXPORTS)
def test_sites_per_exporter(exported, family, exporter, cache):
    model = load(exported(family, exporter, cache))
    graph = model.graph
    rules = {"rmsnorm": (rmsnorm.Decomposed(), rmsnorm.Fused()), "rope": (rope.RotateHalf(), rope_fused.FusedRotary()),
             "swiglu": (swiglu.Gated(),), "attention": (attention.Scores(), attention_fused.FusedAttention())}
    found = {name: [find(rule, graph) for rule in group] for name, group in rules.items()}
    sites = {name: sum(len(s) for s, _ in results) for name, results in found.items()}
    assert sites == {"rmsnorm": 2 * LAYERS + 1, "rope": 2 * LAYERS, "swiglu": LAYERS, "attention": LAYERS}
    assert {name: [m for _, misses in results for m in misses] for name, results in found.items()} == \
        {name: [] for name in rules}


# -- the full pipeline ---------------------------------------------------------------------------
def _compile(model, sdk, cache, passes=None, **options):
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    ctx = _ctx(sdk, model, seq_len=T, cache_len=C if cache else None, **options)
    pipeline = resolve_pipeline(load_registry(), ctx, passes)
    records = run_pipeline(graph, pipeline, ctx)
    return graph, ctx, pipeline, {r.name: r for r in records}


def _mapped(pipeline, ctx, feeds, graph):
    for p in pipeline.passes:
        feeds = p.map_feeds(feeds, ctx)
    return {t.name: feeds[t.name] for t in graph.inputs}


@pytest.mark.parametrize("family,exporter,cache", PIPELINE_EXPORTS)
def test_pipeline_sdk6(exported, family, exporter, cache):
    model = load(exported(family, exporter, cache))
    graph, ctx, pipeline, records = _compile(model, "6.0", cache, rope_mode="pos_emb")
    ops = _ops(graph)
    assert not FORBIDDEN & set(ops), {k: ops[k] for k in FORBIDDEN & set(ops)}
    assert "SimplifiedLayerNormalization" not in ops and "Pow" not in ops
    assert (ops["ReduceMean"], ops["Sigmoid"], ops["Softmax"]) == (2 * LAYERS + 1, LAYERS, LAYERS)
    assert not [n.name for n in graph.nodes if n.op == "Transpose" and len(n.attrs["perm"]) == 3]  # Kᵀ is 4-D
    loose = [t.name for n in graph.nodes for t in n.outputs if t.dtype in (np.int64, np.bool_)]
    assert not loose
    names = {t.name: t for t in graph.inputs}
    assert names["attention_mask"].dtype == np.float32
    assert list(names["attention_mask"].shape) == [1, 1, T, T + (C if cache else 0)]
    assert list(names["pos_emb"].shape)[:3] == [1, 2, T] and "hidden_states" in names
    assert not {"input_ids", "position_ids"} & set(names)
    for pad in (False, True) if cache else (False,):  # padding: a left-padded key in the cache
        feeds = _feeds(model.graph, cache, pad)
        want = run(model.graph, feeds, model.root)
        got = run(graph, _mapped(pipeline, ctx, feeds, graph), model.root)
        logits = [o.name for o in model.graph.outputs][0]
        np.testing.assert_allclose(got[logits], want[logits], atol=1e-4, rtol=0)


@pytest.mark.parametrize("exporter", ["legacy17", "hf-ortfused"])
def test_pipeline_sdk8_keeps_native_rmsnorm_and_rope_table(exported, exporter):
    model = load(exported("qwen2", exporter, True))
    passes = ["bind-shapes", "fold", "cleanup", "mask", "rope", "rmsnorm", "swiglu", "attention", "embedding"]
    graph, ctx, pipeline, records = _compile(model, "8.0", True, passes, rope_mode="table")
    ops = _ops(graph)
    assert ops.get("SimplifiedLayerNormalization") == 2 * LAYERS + 1 and "ReduceMean" not in ops
    assert not {"Sin", "Cos", "RotaryEmbedding", "SkipSimplifiedLayerNormalization", "Where"} & set(ops)
    gathers = [n for n in graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant)]
    assert sorted(n.inputs[0].shape[0] for n in gathers)[:2] == [T + C, T + C]  # cos and sin tables
    feeds = _feeds(model.graph, True)
    want = run(model.graph, feeds, model.root)
    got = run(graph, _mapped(pipeline, ctx, feeds, graph), model.root)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4, rtol=0)


# -- opset 23 and com.microsoft fused ops (synthetic) ----------------------------------------------
def _synthetic(seq=5, hidden=32, heads=4, kv=2, max_pos=16, seed=0):
    """x -> RMSNormalization -> q/k/v -> RotaryEmbedding(q), (k) -> Attention(GQA, causal)."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inv = 1.0 / (1e4 ** (np.arange(0, head, 2) / head))
    angles = np.arange(max_pos)[:, None] * inv[None]
    inits = {"scale": rng.random(hidden) + 0.5, "wq": rng.standard_normal((hidden, hidden)) * 0.3,
             "wk": rng.standard_normal((hidden, kv * head)) * 0.3, "wv": rng.standard_normal((hidden, kv * head)) * 0.3,
             "cos_cache": np.cos(angles), "sin_cache": np.sin(angles)}
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    inits.update(sq=np.array([1, seq, heads, head]), skv=np.array([1, seq, kv, head]), sout=np.array([1, seq, hidden]))
    nodes = [oh.make_node("RMSNormalization", ["x", "scale"], ["n"], axis=-1, epsilon=1e-6)]
    for name, w, shape in (("q", "wq", "sq"), ("k", "wk", "skv"), ("v", "wv", "skv")):
        nodes += [oh.make_node("MatMul", ["n", w], [name]), oh.make_node("Reshape", [name, shape], [name + "3"]),
                  oh.make_node("Transpose", [name + "3"], [name + "4"], perm=[0, 2, 1, 3])]
    nodes += [oh.make_node("RotaryEmbedding", [t + "4", "cos_cache", "sin_cache", "position_ids"], [t + "r"]) for t in "qk"]
    nodes += [oh.make_node("Attention", ["qr", "kr", "v4"], ["y"], is_causal=1),
              oh.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]), oh.make_node("Reshape", ["yt", "sout"], ["out"])]
    graph = oh.make_graph(nodes, "syn23", [oh.make_tensor_value_info("x", TP.FLOAT, [1, seq, hidden]),
                                           oh.make_tensor_value_info("position_ids", TP.INT64, [1, seq])],
                          [oh.make_tensor_value_info("out", TP.FLOAT, [1, seq, hidden])],
                          [nh.from_array(v, k) for k, v in inits.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("sdk,norm_op", [("6.0", "ReduceMean"), ("8.0", "SimplifiedLayerNormalization")])
def test_opset23_fused_ops_are_rewritten(sdk, norm_op):
    proto = _synthetic()
    before, graph = gs.import_onnx(proto), gs.import_onnx(proto)
    ctx = _ctx(sdk)
    counts = [p().run(graph, ctx).rewrites for p in (rmsnorm.RMSNorm, rope.Rope, attention.Attention)]
    assert counts == [1, 2, 1]
    ops = _ops(graph)
    assert not FUSED & set(ops) and ops.get(norm_op) == 1 and ops["Tile"] == 2 and "Neg" not in ops
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 5, 32)).astype(np.float32),
             "position_ids": np.arange(3, 8)[None]}
    np.testing.assert_allclose(run(graph, feeds)["out"], run(before, feeds)["out"], atol=1e-5, rtol=0)


def test_multihead_attention_and_quickgelu_are_rewritten():
    rng = np.random.default_rng(0)
    seq, hidden, heads = 4, 16, 2
    nodes = [oh.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "bias"], ["a"], domain="com.microsoft", num_heads=heads),
             oh.make_node("QuickGelu", ["a"], ["g"], domain="com.microsoft", alpha=1.0),
             oh.make_node("Mul", ["up", "g"], ["out"])]
    inputs = [oh.make_tensor_value_info(n, TP.FLOAT, [1, seq, hidden]) for n in ("q", "k", "v", "up")]
    bias = nh.from_array((rng.standard_normal((1, 1, seq, seq)) * 0.5).astype(np.float32), "bias")
    proto = oh.make_model(oh.make_graph(nodes, "mha", inputs, [oh.make_tensor_value_info("out", TP.FLOAT, [1, seq, hidden])],
                                        [bias]), opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    before, graph = gs.import_onnx(proto), gs.import_onnx(proto)
    ctx = _ctx()
    assert attention.Attention().run(graph, ctx).rewrites == 1
    assert swiglu.SwiGLU().run(graph, ctx).rewrites == 1
    assert not {"MultiHeadAttention", "QuickGelu"} & set(_ops(graph))
    feeds = {n: rng.standard_normal((1, seq, hidden)).astype(np.float32) for n in ("q", "k", "v", "up")}
    np.testing.assert_allclose(run(graph, feeds)["out"], run(before, feeds)["out"], atol=1e-5, rtol=0)


# -- options and refusals ------------------------------------------------------------------------
def test_explain_reasons_for_refused_sites():
    x = gs.Variable("x", np.float32, [1, 3, 8])
    t = [gs.Variable(n, np.float32) for n in ("sq", "mean", "var", "rms", "inv", "norm", "y", "s", "p")]
    axes = gs.Constant("axes", np.array([1], np.int64))
    nodes = [gs.Node("Mul", "square", inputs=[x, x], outputs=[t[0]]),
             gs.Node("ReduceMean", "mean", {"keepdims": 1}, inputs=[t[0], axes], outputs=[t[1]]),
             gs.Node("Add", "add", inputs=[t[1], gs.Constant("eps", np.array(1e-6, np.float32))], outputs=[t[2]]),
             gs.Node("Sqrt", "sqrt", inputs=[t[2]], outputs=[t[3]]),
             gs.Node("Reciprocal", "inv", inputs=[t[3]], outputs=[t[4]]),
             gs.Node("Mul", "norm", inputs=[x, t[4]], outputs=[t[5]]),
             gs.Node("Mul", "gamma", inputs=[t[5], gs.Constant("g", np.ones(8, np.float32))], outputs=[t[6]]),
             gs.Node("Sigmoid", "sig", inputs=[x], outputs=[t[7]]),
             gs.Node("Softmax", "softmax", {"axis": -1}, inputs=[t[7]], outputs=[t[8]])]
    graph = gs.Graph(nodes, [x], [t[6], t[8]], opset=18)
    misses = {m.node: m.reason for p in (rmsnorm.RMSNorm, swiglu.SwiGLU, attention.Attention) for m in p().run(graph, _ctx()).misses}
    assert misses["mean"].startswith("ReduceMean axes [1] (at mean)")
    assert misses["sig"] == "no Mul within 2 steps after Sigmoid sig (at sig)"
    assert misses["softmax"] == "expected Add | MatMul | Mul | Div, found Sigmoid (at sig)"


def test_rope_needs_a_table_size_and_mask_value_option(exported):
    model = load(exported("qwen2", "dynamo", True))
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    result = rope.Rope().run(graph, _ctx(model=model))
    assert {m.reason for m in result.misses} == {"table size unknown: give --seq-len (and --cache-len) or the max_positions option"}
    assert sum(1 for n in graph.nodes if n.op in ("Cos", "Sin")) == 2
    p = mask.Mask()
    ctx = _ctx(model=model, seq_len=T, cache_len=C, mask_value=-50.0)
    assert p.run(graph, ctx).rewrites >= LAYERS
    feeds = p.map_feeds({"attention_mask": np.array([[0] + [1] * (C + T - 1)])}, ctx)
    assert feeds["attention_mask"].shape == (1, 1, T, C + T)
    assert set(np.unique(feeds["attention_mask"])) == {0.0, -50.0} and feeds["attention_mask"][0, 0, 0, 0] == -50.0


def test_embedding_cpu_option_keeps_the_gather(exported):
    model = load(exported("qwen2", "legacy17", False))
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    result = embedding.Embedding().run(graph, _ctx(model=model, embedding="cpu"))
    assert result.rewrites == 0 and "input_ids" in {t.name for t in graph.inputs}
    assert any(n.op == "Gather" for n in graph.nodes)


def test_swiglu_merges_gate_and_up_when_asked(exported):
    model = load(exported("llama", "legacy17", False))
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    before = _ops(graph)["MatMul"]
    assert swiglu.SwiGLU().run(graph, _ctx(model=model, merge_gate_up=True)).rewrites == LAYERS
    assert (_ops(graph)["MatMul"], _ops(graph)["Split"]) == (before - LAYERS, LAYERS)
    feeds = _feeds(model.graph, False)
    np.testing.assert_allclose(run(graph, feeds, model.root)["logits"], run(model.graph, feeds, model.root)["logits"],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("exporter", ["legacy17", "hf-ortfused"])
def test_passes_are_idempotent(exported, exporter):
    model = load(exported("qwen2", exporter, True))
    graph, ctx, pipeline, records = _compile(model, "6.0", True, rope_mode="pos_emb")
    assert [records[p].rewrites > 0 for p in ("rope", "rmsnorm", "attention", "mask", "embedding")] == [True] * 5
    again = {p.name: p().run(graph, ctx) for p in (rope.Rope, rmsnorm.RMSNorm, swiglu.SwiGLU, attention.Attention,
                                                    mask.Mask, embedding.Embedding)}
    assert {name: (r.rewrites, r.misses) for name, r in again.items()} == {name: (0, []) for name in again}


def test_group_query_attention_is_rewritten():
    seq, past, heads, kv, head = 3, 4, 4, 2, 8
    rng = np.random.default_rng(2)
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"], ["y", "present_k", "present_v"],
                        domain="com.microsoft", num_heads=heads, kv_num_heads=kv)
    shapes = {"q": [1, seq, heads * head], "k": [1, seq, kv * head], "v": [1, seq, kv * head],
              "pk": [1, kv, past, head], "pv": [1, kv, past, head]}
    inputs = [oh.make_tensor_value_info(n, TP.FLOAT, s) for n, s in shapes.items()]
    inits = [nh.from_array(np.array([past + seq - 1], np.int32), "seqlens_k"), nh.from_array(np.array(past + seq, np.int32), "total")]
    outputs = [oh.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "present_k", "present_v")]
    proto = oh.make_model(oh.make_graph([node], "gqa", inputs, outputs, inits),
                          opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    before, graph = gs.import_onnx(proto), gs.import_onnx(proto)
    assert attention.Attention().run(graph, _ctx()).rewrites == 1
    assert "GroupQueryAttention" not in _ops(graph) and _ops(graph)["Tile"] == 2
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    got, want = run(graph, feeds), run(before, feeds)
    for name in ("y", "present_k", "present_v"):
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=0)


def test_rope_refuses_unknown_table_size_with_the_reason(exported):
    """Dims left open (the Python API binds nothing by itself): the cos/sin table size is unknown, and
    each refused site says what to give. (compile's CLI binds MediaTek's defaults, so it never gets here.)"""
    model = load(exported("qwen2", "dynamo", False))  # positions come from a Range over the open length
    result = rope.Rope().run(model.graph, _ctx("6.0", model))
    reasons = [m.reason for m in result.misses]
    assert len(reasons) == 2, reasons
    assert all("table size unknown: give --seq-len (and --cache-len) or the max_positions option" in r for r in reasons)


def test_mask_refuses_untouched_when_the_2d_mask_stays_needed():
    scores = gs.Variable("scores", np.float32, [1, 1, 2, 2])
    keep = gs.Variable("attention_mask", np.int64, [1, 2])
    t = {n: gs.Variable(n, np.float32) for n in ("f", "drop", "bias", "x", "p", "count")}
    nodes = [gs.Node("Cast", "cast", {"to": 1}, inputs=[keep], outputs=[t["f"]]),
             gs.Node("Sub", "sub", inputs=[gs.Constant("one", np.array(1.0, np.float32)), t["f"]], outputs=[t["drop"]]),
             gs.Node("Mul", "mul", inputs=[t["drop"], gs.Constant("big", np.array(-1e9, np.float32))], outputs=[t["bias"]]),
             gs.Node("Add", "add", inputs=[scores, t["bias"]], outputs=[t["x"]]),
             gs.Node("Softmax", "softmax", {"axis": -1}, inputs=[t["x"]], outputs=[t["p"]]),
             gs.Node("ReduceSum", "tokens", {"keepdims": 0}, inputs=[t["f"]], outputs=[t["count"]])]
    graph = gs.Graph(nodes, [scores, keep], [t["p"], t["count"]], opset=17)
    result = mask.Mask().run(graph, _ctx(seq_len=2))
    assert result.rewrites == 0 and [n.name for n in graph.nodes] == [n.name for n in nodes]
    assert [(m.node, m.reason) for m in result.misses] == \
        [("cast", "'attention_mask' would still be read by 1 node(s) (bind shapes and fold first)")]
    assert [(t.name, t.dtype) for t in graph.inputs] == [("scores", np.float32), ("attention_mask", np.int64)]


def test_host_tables_travel_in_the_pass_result(exported):
    """embedding (host-input) and rope (pos_emb) return their tables in PassResult.host."""
    model = load(exported("qwen2", "legacy17", False))
    graph, ctx, pipeline, records = _compile(model, "8.0", False, rope_mode="pos_emb")
    table = records["embedding"].host["embedding"]
    assert isinstance(table, gs.Constant) and len(table.shape) == 2
    rope = records["rope"].host["rope"]
    assert rope.dtype == np.float32 and rope.shape[0] == 2 and rope.shape[1] >= T
    assert {n: r.host for n, r in records.items() if r.host}.keys() == {"embedding", "rope"}
    assert {t.name for t in graph.inputs} >= {"hidden_states", "pos_emb"}
