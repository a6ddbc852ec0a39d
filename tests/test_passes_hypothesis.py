"""Generated small graphs through fold, cleanup, int64-to-int32, rank4, opset17, legalize.

Each example: build a graph, run it in onnxruntime, apply the passes, run again. Outputs must be
equal (float: 1e-5), invariants hold (no int64 runtime tensor after int64-to-int32, no rank-5
tensor after rank4, no Shape after fold), and a second run of every pass rewrites nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtkc.ir import execute, shapes
from mtkc.passes import cleanup, fold, int32, legalize, opset17, rank4
from mtkc.rewrite.pass_api import Context

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CTX = Context(table=None)

dims = st.integers(1, 4)
shapes_ = st.lists(dims, min_size=1, max_size=4)


def _run_passes(graph, passes, feeds):
    shapes.infer(graph)
    expected = execute.run(graph, feeds)
    instances = []
    for cls in passes:
        p = cls()
        p.run(graph, CTX)
        graph.cleanup().toposort()
        assert cls().run(graph, CTX).rewrites == 0, f"{cls.name} is not idempotent"
        graph.cleanup().toposort()
        instances.append(p)
    for p in instances:
        feeds = p.map_feeds(feeds, CTX)
        expected = p.map_outputs(expected, CTX)
    actual = execute.run(graph, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    return graph


@st.composite
def elementwise_graphs(draw):
    """x -> a chain of unary/binary ops (constants of lower rank, casts, transposes, reshapes)."""
    shape = draw(shapes_)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = gs.Variable("x", np.float32, shape)
    nodes, cur, k = [], x, 0

    def out():
        nonlocal k
        k += 1
        return gs.Variable(f"t{k}")

    for _ in range(draw(st.integers(1, 7))):
        rank = len(cur.shape)
        op = draw(st.sampled_from(["Add", "Mul", "Sub", "Neg", "Pow", "Cast2", "CastLossy", "Identity",
                                   "TransposePair", "ReshapeChain", "Expand", "Sigmoid", "Dup"]))
        y = out()
        if op in ("Add", "Mul", "Sub"):
            sub = cur.shape[draw(st.integers(0, rank)):]
            c = gs.Constant(f"c{k}", rng.standard_normal(sub).astype(np.float32))
            nodes.append(gs.Node(op, inputs=[cur, c] if draw(st.booleans()) else [c, cur], outputs=[y]))
        elif op == "Neg" or op == "Sigmoid" or op == "Identity":
            nodes.append(gs.Node(op, inputs=[cur], outputs=[y]))
        elif op == "Pow":
            e = draw(st.sampled_from([2.0, 3.0]))
            nodes.append(gs.Node("Pow", inputs=[cur, gs.Constant(f"e{k}", np.array(e, np.float32))], outputs=[y]))
        elif op == "Cast2":
            m = out()
            nodes += [gs.Node("Cast", attrs={"to": onnx.TensorProto.DOUBLE}, inputs=[cur], outputs=[m]),
                      gs.Node("Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[m], outputs=[y])]
        elif op == "CastLossy":
            m = out()
            nodes += [gs.Node("Cast", attrs={"to": onnx.TensorProto.INT32}, inputs=[cur], outputs=[m]),
                      gs.Node("Cast", attrs={"to": onnx.TensorProto.FLOAT}, inputs=[m], outputs=[y])]
        elif op == "TransposePair":
            p = list(draw(st.permutations(range(rank))))
            q = list(draw(st.permutations(range(rank))))
            m = out()
            nodes += [gs.Node("Transpose", attrs={"perm": p}, inputs=[cur], outputs=[m]),
                      gs.Node("Transpose", attrs={"perm": q}, inputs=[m], outputs=[y])]
        elif op == "ReshapeChain":
            m = out()
            nodes += [gs.Node("Unsqueeze", inputs=[cur, gs.Constant(f"a{k}", np.array([0], np.int64))], outputs=[m]),
                      gs.Node("Reshape", inputs=[m, gs.Constant(f"s{k}", np.array([-1], np.int64))], outputs=[y])]
        elif op == "Expand":
            nodes.append(gs.Node("Expand", inputs=[cur, gs.Constant(f"s{k}", np.array([1] * rank, np.int64))], outputs=[y]))
        elif op == "Dup":  # the same subexpression twice
            a, b = out(), out()
            nodes += [gs.Node("Sigmoid", inputs=[cur], outputs=[a]), gs.Node("Sigmoid", inputs=[cur], outputs=[b]),
                      gs.Node("Add", inputs=[a, b], outputs=[y])]
        shapes.infer(gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=17))
        cur = y
    cur.dtype = np.float32
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[cur], opset=17)
    feeds = {"x": (rng.standard_normal(shape) * 3).astype(np.float32)}
    return graph, feeds


@FAST
@given(elementwise_graphs())
def test_elementwise_graphs_survive_fold_cleanup_legalize(case):
    graph, feeds = case
    graph = _run_passes(graph, [fold.Fold, cleanup.Cleanup, legalize.Legalize, cleanup.Cleanup], feeds)
    assert not any(n.op == "Neg" for n in graph.nodes)
    # an Identity survives only where it links a graph input straight to a graph output
    assert all(n.inputs[0] in graph.inputs and n.outputs[0] in graph.outputs for n in graph.nodes if n.op == "Identity")
    for n in graph.nodes:
        if n.op in legalize.BROADCAST_OPS:
            assert len({len(t.shape) for t in n.inputs}) == 1, n


@st.composite
def shape_chain_graphs(draw):
    """Reshape(x, Concat(Unsqueeze(Gather(Shape(x), i)), -1)) and friends, all foldable."""
    shape = draw(st.lists(dims, min_size=2, max_size=4))
    x = gs.Variable("x", np.float32, shape)
    keep = draw(st.integers(0, len(shape) - 1))
    s, g, u, c, y, z = (gs.Variable(n) for n in ("s", "g", "u", "c", "y", "z"))
    nodes = [gs.Node("Shape", inputs=[x], outputs=[s]),
             gs.Node("Gather", attrs={"axis": 0}, inputs=[s, gs.Constant("i", np.array(keep, np.int64))], outputs=[g]),
             gs.Node("Unsqueeze", inputs=[g, gs.Constant("ax", np.array([0], np.int64))], outputs=[u]),
             gs.Node("Concat", attrs={"axis": 0}, inputs=[u, gs.Constant("m1", np.array([-1], np.int64))], outputs=[c]),
             gs.Node("Transpose", attrs={"perm": [keep] + [d for d in range(len(shape)) if d != keep]}, inputs=[x], outputs=[z]),
             gs.Node("Reshape", inputs=[z, c], outputs=[y])]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=draw(st.sampled_from([17, 18])))
    feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    return graph, feeds


@FAST
@given(shape_chain_graphs())
def test_shape_chains_fold_away(case):
    graph, feeds = case
    graph = _run_passes(graph, [fold.Fold, cleanup.Cleanup, opset17.Opset17], feeds)
    assert [n.op for n in graph.nodes] in (["Transpose", "Reshape"], ["Reshape"], ["Transpose"])
    assert graph.opset == 17


@st.composite
def rank5_graphs(draw):
    """[a,b,c,d] -> Unsqueeze(k) -> Expand(n on k) -> elementwise with a constant -> Reshape 4-D."""
    shape = draw(st.lists(dims, min_size=4, max_size=4))
    k = draw(st.integers(0, 4))
    n = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = gs.Variable("x", np.float32, shape)
    e5 = shape[:k] + [n] + shape[k:]
    u, e, m, y = gs.Variable("u"), gs.Variable("e"), gs.Variable("m"), gs.Variable("y")
    cshape = e5[draw(st.integers(0, 5)):]
    if cshape and draw(st.booleans()):
        cshape = [1] + cshape[1:]
    const = gs.Constant("c", rng.standard_normal(cshape).astype(np.float32))
    merged = e5[:k] + [e5[k] * e5[k + 1]] + e5[k + 2:] if k < 4 else e5[:3] + [e5[3] * e5[4]]
    nodes = [gs.Node("Unsqueeze", inputs=[x, gs.Constant("ax", np.array([k], np.int64))], outputs=[u]),
             gs.Node("Expand", inputs=[u, gs.Constant("es", np.array(e5, np.int64))], outputs=[e]),
             gs.Node(draw(st.sampled_from(["Add", "Mul"])), inputs=[e, const], outputs=[m]),
             gs.Node("Reshape", inputs=[m, gs.Constant("rs", np.array(merged, np.int64))], outputs=[y])]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=17)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    return graph, feeds


@FAST
@given(rank5_graphs())
def test_rank5_chains_become_rank4(case):
    graph, feeds = case
    graph = _run_passes(graph, [rank4.Rank4], feeds)
    assert all(t.shape is None or len(t.shape) <= 4 for t in graph.tensors().values())


@st.composite
def int64_graphs(draw):
    """int64 ids -> Add/Mul/Where with int64 constants -> Gather from a float table -> Slice."""
    n = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    ids = gs.Variable("ids", np.int64, [1, n])
    table = gs.Constant("table", rng.standard_normal((20, 4)).astype(np.float32))
    a, b, g, y = gs.Variable("a"), gs.Variable("b"), gs.Variable("g"), gs.Variable("y")
    op = draw(st.sampled_from(["Add", "Mul", "Max"]))
    nodes = [gs.Node(op, inputs=[ids, gs.Constant("k", np.array([draw(st.integers(0, 2))], np.int64))], outputs=[a]),
             gs.Node("Min", inputs=[a, gs.Constant("hi", np.array(19, np.int64))], outputs=[b]),
             gs.Node("Gather", inputs=[table, b], outputs=[g]),
             gs.Node("Slice", inputs=[g, gs.Constant("st", np.array([draw(st.integers(0, 3))], np.int64)),
                                      gs.Constant("en", np.array([np.iinfo(np.int64).max], np.int64)),
                                      gs.Constant("axs", np.array([-1], np.int64))], outputs=[y])]
    graph = gs.Graph(nodes=nodes, inputs=[ids], outputs=[y], opset=17)
    feeds = {"ids": rng.integers(0, 10, (1, n)).astype(np.int64)}
    return graph, feeds


@FAST
@given(int64_graphs())
def test_int64_graphs_become_int32(case):
    graph, feeds = case
    graph = _run_passes(graph, [int32.Int64ToInt32, fold.Fold, cleanup.Cleanup], feeds)
    assert [t.name for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.dtype == np.int64] == []
    assert graph.inputs[0].dtype == np.int32


@pytest.mark.slow
@SLOW
@given(st.one_of(elementwise_graphs(), shape_chain_graphs(), rank5_graphs()))
def test_many_more_graphs(case):
    graph, feeds = case
    passes = [fold.Fold, cleanup.Cleanup, opset17.Opset17, rank4.Rank4, legalize.Legalize, cleanup.Cleanup]
    _run_passes(graph, passes, feeds)
