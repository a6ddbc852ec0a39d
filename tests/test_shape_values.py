"""Shape operands evaluated from static shapes (`mtkc.ir.shape_values`), against onnxruntime, and
the shapes inference gives with them against onnxruntime's symbolic inference (the path before)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper

from mtkc.errors import InputError
from mtkc.ir import shape_values, shapes
from mtkc.ir.model import load
from mtkc.options import Options
from mtkc.passes.bind_shapes import BindShapes
from mtkc.rewrite.pass_api import Context
from mtkc.target.capability import load_table


def _shape_graph(dims: list[int], divisor: int, offset: int) -> onnx.ModelProto:
    """x[dims] -> the shape maths TorchScript exports emit (Gather, Div, Neg, Where, Range, Slice, ...)."""
    c = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [len(v)] if isinstance(v, list) else [], v if isinstance(v, list) else [v])  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i_last"], ["d"], axis=0),
        helper.make_node("Div", ["d", "k"], ["half"]),
        helper.make_node("Neg", ["half"], ["neg"]),
        helper.make_node("Div", ["neg", "k"], ["negdiv"]),  # truncates toward zero
        helper.make_node("Add", ["d", "off"], ["end"]),
        helper.make_node("Range", ["half", "end", "one"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Unsqueeze", ["half", "zero1"], ["half1"]),
        helper.make_node("Concat", ["half1", "rs", "s"], ["cat"], axis=0),
        helper.make_node("Equal", ["cat", "one1"], ["eq"]),
        helper.make_node("Where", ["eq", "minus1", "cat"], ["w"]),
        helper.make_node("Slice", ["w", "one1", "big1"], ["sl"]),
        helper.make_node("Cast", ["sl"], ["c32"], to=TensorProto.INT32),
        helper.make_node("ConstantOfShape", ["rs"], ["ones"], value=helper.make_tensor("v", TensorProto.INT64, [1], [1])),
        helper.make_node("ReduceSum", ["ones"], ["total"], keepdims=0),  # not evaluated: stays unknown
    ]
    inits = [c("i_last", -1), c("k", divisor), c("off", offset), c("one", 1), c("zero1", [0]), c("one1", [1]),
             c("minus1", [-1]), c("big1", [2**62])]
    outs = ["half", "negdiv", "end", "r", "cat", "w", "sl", "c32", "ones", "total"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(o, TensorProto.INT32 if o == "c32" else TensorProto.INT64, None)
                               for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@settings(max_examples=25, deadline=None)
@given(dims=st.lists(st.integers(1, 9), min_size=1, max_size=4), divisor=st.sampled_from([1, 2, 3, -2]),
       offset=st.integers(-3, 6))
def test_known_values_are_what_onnxruntime_computes(dims, divisor, offset):
    proto = _shape_graph(dims, divisor, offset)
    graph = gs.import_onnx(proto)
    graph.inputs[0].shape = dims
    known = shape_values.known_values(graph)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    actual = dict(zip(names, session.run(None, {"x": np.zeros(dims, np.float32)})))
    assert "total" not in known  # a reduction is not a shape operand
    for name in names:
        if name == "total" or (name == "ones" and actual[name].size > shape_values.MAX_ELEMENTS):
            continue
        assert name in known, name
        np.testing.assert_array_equal(known[name], actual[name], err_msg=name)
        assert known[name].dtype == actual[name].dtype, name


def _bound(path, options: Options, symbolic: bool, monkeypatch) -> dict[str, tuple]:
    model = load(path)
    with monkeypatch.context() as m:
        if symbolic:
            m.setattr(shapes, "VALUE_ROUNDS", 0)
        BindShapes().run(model.graph, Context(load_table("8.0"), options, model.root, model.values))
    return {n: (np.dtype(t.dtype).name if t.dtype is not None else None, None if t.shape is None else tuple(t.shape))
            for n, t in model.graph.tensors().items() if isinstance(t, gs.Variable)}


@pytest.mark.parametrize("family, exporter, cache", [
    ("qwen2", "legacy17", True), ("qwen2", "legacy14", False), ("llama", "legacy17", True),
    ("qwen2", "dynamo", True), ("qwen2", "hf", False), ("gemma2", "legacy17", False),
])
def test_bound_shapes_equal_onnxruntimes_symbolic_inference(exported, monkeypatch, family, exporter, cache):
    path = exported(family, exporter, cache=cache)
    options = Options(seq_len=8, cache_len=64 if cache else None)
    fast, symbolic = _bound(path, options, False, monkeypatch), _bound(path, options, True, monkeypatch)
    assert fast.keys() == symbolic.keys()
    differ = {n: (fast[n], symbolic[n]) for n in fast
              if symbolic[n][1] is not None and all(isinstance(d, int) for d in symbolic[n][1]) and fast[n] != symbolic[n]}
    assert not differ, list(differ.items())[:5]
    assert all(s[1] is not None and all(isinstance(d, int) for d in s[1]) for n, s in fast.items()
               if symbolic[n][1] is not None and all(isinstance(d, int) for d in symbolic[n][1]))


def test_a_range_its_shape_operands_make_huge_is_refused_not_propagated(tmp_path):
    """Range(0, Shape(x)[0] * 2^40): its bound is known once x is bound; inference must not spell it out."""
    big = helper.make_tensor("big", TensorProto.INT64, [], [2**40])
    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Mul", ["n", "big"], ["limit"]), helper.make_node("Range", ["zero", "limit", "one"], ["r"])]
    graph = gs.import_onnx(helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("r", TensorProto.INT64, None)], [big, zero, one]),
        opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(InputError, match="Range.*at most 2\\^31"):
        shapes.infer(graph)
