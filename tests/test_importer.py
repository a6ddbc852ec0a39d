"""mtkc.ir.importer: the graph graphsurgeon's import gives, object for object, or None when the model
needs graphsurgeon's own import."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto

from mtkc.ir import model as mmodel
from mtkc.ir.importer import import_model

EXPORTS = [("qwen2", "legacy17", True), ("qwen2", "legacy14", False), ("qwen2", "dynamo", True),
           ("qwen2", "hf", True), ("qwen2", "optimum", True), ("qwen2", "genai-fp32", True),
           ("qwen2", "genai-int4", True), ("llama", "ortopt", True), ("gemma2", "legacy17", True)]
GRAPH_FIELDS = ("nodes", "inputs", "outputs", "_functions", "import_domains")


def same_graph(ours: gs.Graph, theirs: gs.Graph) -> None:
    """Field by field, in field order; nodes and tensors paired by position and by first meeting,
    every link (producers, readers, node inputs and outputs) through that pairing."""
    pairs: dict[int, object] = {}  # id(ours) -> theirs

    def pair(a, b) -> bool:
        """Record a pairing; False when it was made before (already compared)."""
        if id(a) in pairs:
            assert pairs[id(a)] is b
            return False
        pairs[id(a)] = b
        return True

    def tensor(a: gs.Tensor, b: gs.Tensor) -> None:
        assert type(a) is type(b)
        if not pair(a, b):
            return
        assert list(a.__dict__) == list(b.__dict__)
        for key, value in a.__dict__.items():
            if key in ("inputs", "outputs"):
                assert type(value) is type(b.__dict__[key]) and len(value) == len(b.__dict__[key])
                assert (value.parent_obj, value.field_name) == (a, b.__dict__[key].field_name)
            elif key == "_values":
                other = b._values
                assert type(value) is type(other) and value.tensor is other.tensor
                assert (value.shape, value.dtype, value.nbytes) == (other.shape, other.dtype, other.nbytes)
            else:
                assert value == b.__dict__[key], key
        for x, y in ((a.inputs, b.inputs), (a.outputs, b.outputs)):
            for n, m in zip(x, y):
                node(n, m)

    def attr(a, b) -> None:
        if isinstance(a, gs.Tensor):
            tensor(a, b)
        else:
            assert type(a) is type(b) and a == b

    def node(a: gs.Node, b: gs.Node) -> None:
        if not pair(a, b):
            return
        assert list(a.__dict__) == list(b.__dict__)
        assert (a.op, a.name, a.domain) == (b.op, b.name, b.domain)
        assert type(a.attrs) is type(b.attrs) and list(a.attrs) == list(b.attrs)
        for key in a.attrs:
            attr(a.attrs[key], b.attrs[key])
        for x, y, field in ((a.inputs, b.inputs, "outputs"), (a.outputs, b.outputs, "inputs")):
            assert type(x) is type(y) and len(x) == len(y) and (x.parent_obj, x.field_name) == (a, field)
            for t, u in zip(x, y):
                tensor(t, u)

    assert list(ours.__dict__) == list(theirs.__dict__)
    for key, value in ours.__dict__.items():
        if key not in GRAPH_FIELDS:
            assert value == theirs.__dict__[key], key
    assert ours.import_domains is theirs.import_domains and ours._functions == theirs._functions == []
    assert len(ours.nodes) == len(theirs.nodes)
    for a, b in zip(ours.nodes, theirs.nodes):
        node(a, b)
    for x, y in ((ours.inputs, theirs.inputs), (ours.outputs, theirs.outputs)):
        assert type(x) is type(y) and len(x) == len(y)
        for a, b in zip(x, y):
            tensor(a, b)
    assert gs.export_onnx(ours).SerializeToString() == gs.export_onnx(theirs).SerializeToString()


@pytest.mark.parametrize("family,exporter,cache", EXPORTS)
def test_an_export_imports_as_graphsurgeon_imports_it(family, exporter, cache, exported):
    proto = mmodel.read_proto(exported(family, exporter, cache))
    ours = import_model(proto)
    assert ours is not None
    same_graph(ours, gs.import_onnx(proto))


def _model(nodes, inputs, outputs, initializers=(), value_info=(), **kwargs) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(initializers), value_info=list(value_info))
    return oh.make_model(graph, opset_imports=kwargs.pop("opsets", [oh.make_opsetid("", 17)]), **kwargs)


def test_odd_but_valid_graphs_import_as_graphsurgeon_imports_them():
    """Omitted optional inputs and outputs (a new unnamed tensor each), a tensor read before the node
    that makes it, a value info refining an initializer's name and an input, a node with an empty
    domain field and one without, every plain attribute kind, a repeated input, an unused initializer."""
    w = oh.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    unused = oh.make_tensor("unused", TensorProto.INT64, [1], [3])
    value = oh.make_tensor("v", TensorProto.FLOAT, [2], [0.5, 0.25])
    nodes = [
        oh.make_node("Add", ["late", "late"], ["twice"], name="reads_first"),
        oh.make_node("Mul", ["x", "w"], ["late"], name="mul", domain=""),
        oh.make_node("Clip", ["twice", "", "c"], ["clipped"], name="clip"),
        oh.make_node("Constant", [], ["c"], name="const", value=value),
        oh.make_node("Dropout", ["clipped"], ["y", ""], name="drop"),
        oh.make_node("Custom", ["y"], ["z"], name="custom", domain="my.ops", f=1.5, i=3, s="text",
                     floats=[1.0, 2.0], ints=[4, 5], strings=["a", "b"]),
    ]
    nodes[1].ClearField("domain")
    proto = _model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
                   [oh.make_tensor_value_info("z", TensorProto.FLOAT, None)], [w, unused],
                   [oh.make_tensor_value_info("late", TensorProto.FLOAT, ["n", 2]),
                    oh.make_tensor_value_info("w", TensorProto.FLOAT, [2]),
                    oh.make_tensor_value_info("twice", TensorProto.FLOAT, None),
                    oh.make_tensor_value_info("twice", TensorProto.UNDEFINED, ["n", 2])],
                   opsets=[oh.make_opsetid("", 17), oh.make_opsetid("my.ops", 1)])
    proto.graph.input.append(oh.make_tensor_value_info("w", TensorProto.FLOAT, [2]))  # an initializer listed as input
    ours = import_model(proto)
    assert ours is not None
    same_graph(ours, gs.import_onnx(proto))
    assert ours.nodes[2].inputs[1].name == "" and ours.nodes[4].outputs[1].name == ""
    np.testing.assert_array_equal(ours.nodes[3].attrs["value"].values, [0.5, 0.25])


def _with_subgraph() -> onnx.ModelProto:
    branch = lambda name: oh.make_graph([oh.make_node("Identity", ["x"], [f"{name}_out"])], name, [],  # noqa: E731
                                        [oh.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2])])
    return _model([oh.make_node("If", ["c"], ["y"], then_branch=branch("a"), else_branch=branch("b"))],
                  [oh.make_tensor_value_info("c", TensorProto.BOOL, []), oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])])


def _with_function() -> onnx.ModelProto:
    fn = oh.make_function("local", "double", ["a"], ["b"], [oh.make_node("Add", ["a", "a"], ["b"])],
                          [oh.make_opsetid("", 17)])
    return _model([oh.make_node("double", ["x"], ["y"], domain="local")],
                  [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                  opsets=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)], functions=[fn])


def _with_attribute(attribute: onnx.AttributeProto) -> onnx.ModelProto:
    node = oh.make_node("Relu", ["x"], ["y"])
    node.attribute.append(attribute)
    return _model([node], [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])])


def _with_sparse_initializer() -> onnx.ModelProto:
    proto = _model([oh.make_node("Relu", ["x"], ["y"])], [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    values = oh.make_tensor("s", TensorProto.FLOAT, [1], [1.0])
    proto.graph.sparse_initializer.append(oh.make_sparse_tensor(values, oh.make_tensor("i", TensorProto.INT64, [1], [0]), [2]))
    return proto


def _without_default_opset() -> onnx.ModelProto:
    return _model([oh.make_node("Op", ["x"], ["y"], domain="my.ops")], [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])], opsets=[oh.make_opsetid("my.ops", 1)])


@pytest.mark.parametrize("make", [
    _with_subgraph, _with_function, _with_sparse_initializer, _without_default_opset,
    lambda: _with_attribute(oh.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT)),
    lambda: _with_attribute(oh.make_attribute("graphs", [oh.make_graph([], "e", [], [])])),
    lambda: _with_attribute(onnx.AttributeProto(name="undefined", type=onnx.AttributeProto.UNDEFINED)),
], ids=["subgraph", "function", "sparse initializer", "no default opset", "attribute reference", "graphs attribute",
        "undefined attribute"])
def test_what_it_does_not_import_plainly_is_left_to_graphsurgeon(make):
    assert import_model(make()) is None


def test_load_takes_the_plain_import_and_graphsurgeon_s_for_the_rest(tmp_path, monkeypatch):
    from mtkc.ir import importer

    taken = []
    monkeypatch.setattr(mmodel, "import_model", lambda proto: taken.append(importer.import_model(proto)) or taken[-1])
    leaky = lambda: _model([oh.make_node("LeakyRelu", ["x"], ["y"], alpha=0.5)],  # noqa: E731
                           [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                           [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    for make in (_with_subgraph, leaky):
        path = tmp_path / f"{len(taken)}.onnx"
        onnx.save(make(), path)
        model = mmodel.load(path)
        assert [n.op for n in model.graph.nodes] == [make().graph.node[0].op_type]
    assert taken[0] is None and isinstance(taken[1], gs.Graph)
