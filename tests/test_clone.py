"""mtkc.ir.clone / Model.copy: a copy of an untouched graph is the graph a re-import gives, and
owns every node, tensor, list and opset id a pass may edit."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_graphsurgeon as gs
import pytest

from mtkc.ir import model as mmodel
from mtkc.ir.clone import clone
from mtkc.ir.graph_utils import cleanup, tensor_map

EXPORTS = [("legacy17", True), ("legacy14", False), ("dynamo", True), ("hf", True), ("optimum", True),
           ("genai-fp32", True), ("genai-int4", True)]


def _bytes(graph: gs.Graph) -> bytes:
    return gs.export_onnx(graph).SerializeToString(deterministic=True)


def _links(graph: gs.Graph) -> list:
    """Every walk a pass takes: tensors in map order with their producers and consumers (in order),
    nodes with their inputs and outputs, the graph's inputs and outputs."""
    tensors = [(name, type(t).__name__, [n.name for n in t.inputs], [n.name for n in t.outputs])
               for name, t in graph.tensors().items()]
    nodes = [(n.name, [t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes]
    return [tensors, nodes, [t.name for t in graph.inputs], [t.name for t in graph.outputs]]


@pytest.mark.parametrize("exporter,cache", EXPORTS)
def test_a_copy_is_the_graph_imported_again(exporter, cache, exported):
    model = mmodel.load(exported("qwen2", exporter, cache))
    copy, fresh = model.copy(), model.fresh()
    assert copy.graph is not model.graph and copy.proto is model.proto
    assert _bytes(copy.graph) == _bytes(fresh.graph)
    assert _links(copy.graph) == _links(fresh.graph)
    assert list(tensor_map(copy.graph).items()) == list(copy.graph.tensors().items())
    old = {id(x) for x in [*model.graph.nodes, *model.graph.tensors().values()]}
    assert not old & {id(x) for x in [*copy.graph.nodes, *copy.graph.tensors().values()]}
    weight = next(t for t in copy.graph.tensors().values() if isinstance(t, gs.Constant) and t.shape)
    np.testing.assert_array_equal(copy.values(weight), fresh.values(fresh.graph.tensors()[weight.name]))


def test_editing_a_copy_leaves_the_original_as_it_was(exported):
    """In-place edits of lists (shapes, attributes, node I/O), names, opset ids and node removal."""
    model = mmodel.load(exported("qwen2", "legacy17", True))
    before, links = _bytes(model.graph), _links(model.graph)
    graph = model.copy().graph
    for t in graph.tensors().values():
        if isinstance(t, gs.Variable) and t.shape:
            t.shape[0] = 7
        t.name = f"x/{t.name}"
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, list) and value:
                value[0] = value[0] * 2 if not isinstance(value[0], str) else "x"
            if isinstance(value, gs.Constant):
                value.name = "renamed"
        node.name = f"x/{node.name}"
    graph.import_domains[0].version = 99
    graph.outputs = graph.outputs[:1]
    cleanup(graph)
    graph.nodes[0].inputs.clear()
    assert _bytes(model.graph) == before and _links(model.graph) == links


def test_a_graph_with_a_subgraph_is_imported_again(tmp_path):
    """An If's branches read the outer graph's tensors: clone refuses, Model.copy re-imports."""
    branch = lambda name, op: oh.make_graph([oh.make_node(op, ["X", "X"], [f"{name}_out"], name=name)], name, [],  # noqa: E731
                                            [oh.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, [2])])
    nodes = [oh.make_node("If", ["C"], ["Y"], name="if", then_branch=branch("then", "Add"),
                          else_branch=branch("else", "Mul"))]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("C", onnx.TensorProto.BOOL, []),
                                       oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2])])
    path = tmp_path / "model.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    model = mmodel.load(path)
    assert clone(model.graph) is None
    copy = model.copy()
    assert copy.graph is not model.graph and _bytes(copy.graph) == _bytes(model.graph)


def test_tensor_map_is_graphsurgeons_map():
    """A repeated name keeps its first place and its last tensor, as `Graph.tensors()` does."""
    x, y, twin = gs.Variable("x", np.float32, [2]), gs.Variable("y"), gs.Variable("x")
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[y]), gs.Node("Neg", inputs=[y], outputs=[twin])],
                     inputs=[x], outputs=[twin, gs.Variable.empty()])
    assert list(tensor_map(graph).items()) == list(graph.tensors().items()) == [("x", twin), ("y", y)]
