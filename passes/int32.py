"""int64-to-int32: every int64 runtime tensor becomes int32 (NeuroPilot has no INT64 tensors).

    graph input  input_ids / position_ids / attention_mask : int64   -> int32
                 (token ids < vocab, positions < context, mask bits: all < 2**31)
    constant     int64 at a data operand (Gather indices, Add, Where, Equal, Slice
                 starts/ends, Range ...)                           -> int32 when every value fits
                 (Slice: INT64_MAX/MIN ends clamp to INT32_MAX/MIN, same meaning)
    Cast(to=INT64)                                                 -> Cast(to=INT32)
    ConstantOfShape(value: int64)                                  -> value int32
    everything downstream                                          -> int32 by shape inference

Kept int64, by the ONNX spec (these operands must be int64): the *constant* shape operands
Reshape.shape, Expand.shape, Tile.repeats, ConstantOfShape.input, Unsqueeze/Squeeze.axes,
Reduce*.axes, Pad.pads, Split.split, Resize.sizes, TopK.K, GatherND/ScatterND.indices, Loop.M. They
are not runtime tensors: converters read them as static attributes (the capability check
should accept int64 constants there; it must reject int64 runtime tensors).
Refuses (Miss): constants whose values do not fit, ops whose output is int64 by definition
(Shape, ArgMax, NonZero, ...: a Cast to int32 follows them), runtime tensors feeding an
int64-only operand (a Cast back to int64 precedes them). Graph I/O dtype changes are a
contract change: `map_feeds` casts the inputs it converted.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.ir import shapes
from mtkc.ir.constants import values
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

I32 = np.iinfo(np.int32)
REDUCE = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
          "ReduceLogSumExp", "ReduceSumSquare", "ReduceSum"}
INT64_SLOTS = {"Reshape": {1}, "Expand": {1}, "Tile": {1}, "ConstantOfShape": {0}, "Unsqueeze": {1},
               "Squeeze": {1}, "Pad": {1}, "Split": {1}, "Resize": {3}, "TopK": {1}, "GatherND": {1},
               "ScatterND": {1}, "Upsample": {1}, "Loop": {0}, **{op: {1} for op in REDUCE}}  # Loop: trip count
INT64_OUTPUTS = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "Unique", "TopK"}
CLAMP_OPS = {"Slice"}


def int64_slot(node: gs.Node, index: int) -> bool:
    return index in INT64_SLOTS.get(node.op, ()) and node.domain in (None, "", "ai.onnx")


def _is_i64(t: gs.Tensor) -> bool:
    return gu.dtype_of(t) == np.int64


@register
class Int64ToInt32(Pass):
    name = "int64-to-int32"
    description = "int64 inputs, indices and positions -> int32 (int64 constant shape operands stay)"

    def __init__(self):
        self.converted_inputs: list[str] = []
        self.converted_outputs: list[str] = []

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        names = gu.Names(graph)
        settled = shapes.settled(graph)
        touched: list[gs.Node] = []  # nodes whose input dtypes or attributes change
        int64_outputs = [t for t in graph.outputs if _is_i64(t)]
        for t in graph.inputs:
            if _is_i64(t):
                t.dtype = np.int32
                self.converted_inputs.append(t.name)
                result.rewrites += 1
                result.notes.append(f"input '{t.name}' is now int32 (feed int32)")
                touched += t.outputs
        result.rewrites += _convert_constants(graph, ctx, names, result.misses, touched)
        for node in graph.nodes:
            if node.op == "Cast" and node.attrs.get("to") == onnx.TensorProto.INT64:
                node.attrs["to"] = onnx.TensorProto.INT32
                result.rewrites += 1
                touched.append(node)
            elif node.op == "ConstantOfShape" and isinstance(node.attrs.get("value"), gs.Constant):
                value = node.attrs["value"]
                if gu.dtype_of(value) == np.int64 and _fits(values(value, ctx.read_values)):
                    node.attrs["value"] = gs.Constant(value.name, values(value, ctx.read_values).astype(np.int32))
                    result.rewrites += 1
                    touched.append(node)
        result.rewrites += _cast_int64_outputs(graph, names, result.misses, touched)
        if not (settled and shapes.retype(graph, touched)):  # only dtypes changed: downstream of them
            shapes.infer(graph, ctx.root)
        result.rewrites += _restore_int64_slots(graph, names, result.misses)
        result.rewrites += _drop_noop_casts(graph)
        for t in int64_outputs:
            if gu.dtype_of(t) == np.int32:
                self.converted_outputs.append(t.name)
                result.notes.append(f"output '{t.name}' is now int32")
        outputs = {t.name for t in graph.outputs}
        for node in graph.nodes:
            for t in node.outputs:
                if _is_i64(t) and node.op not in INT64_OUTPUTS and not all(_feeds_slot(t)):
                    where = "graph output" if t.name in outputs else "tensor"
                    result.misses.append(Miss(node.name, f"{where} '{t.name}' is still int64"))
        return result

    def map_feeds(self, feeds, ctx):
        return {k: v.astype(np.int32) if k in self.converted_inputs else v for k, v in feeds.items()}

    def map_outputs(self, outputs, ctx):
        return {k: v.astype(np.int32) if k in self.converted_outputs else v for k, v in outputs.items()}


def _fits(v: np.ndarray) -> bool:
    return v.size == 0 or (int(v.min()) >= I32.min and int(v.max()) <= I32.max)


def _convert_constants(graph: gs.Graph, ctx: Context, names: gu.Names, misses: list[Miss], touched: list) -> int:
    """int64 constants at data operands -> int32 copies (shared per constant and clamping); their readers join `touched`."""
    done: dict[tuple[int, bool], gs.Constant | None] = {}
    n = 0
    for node in graph.nodes:
        for i, t in enumerate(node.inputs):
            if not isinstance(t, gs.Constant) or not _is_i64(t) or int64_slot(node, i):
                continue
            clamp = node.op in CLAMP_OPS
            key = (id(t), clamp)
            if key not in done:
                v = values(t, ctx.read_values)
                if clamp:
                    v = np.clip(v, I32.min, I32.max)
                done[key] = gs.Constant(names.new(f"{t.name}/i32"), np.asarray(v, dtype=np.int32)) if _fits(v) else None
            if done[key] is None:
                misses.append(Miss(node.name, f"constant '{t.name}' has values outside int32"))
                continue
            gu.set_input(node, i, done[key])  # t has many readers: unhook by identity
            touched.append(node)
            n += 1
    return n


def _cast_int64_outputs(graph: gs.Graph, names: gu.Names, misses: list[Miss], touched: list) -> int:
    """Shape/ArgMax/...: int64 by definition; a Cast(to=INT32) takes over their data consumers (`touched`)."""
    n = 0
    for node in list(graph.nodes):
        if node.op not in INT64_OUTPUTS or node.domain not in (None, "", "ai.onnx"):
            continue
        for out in node.outputs:
            data_uses = [(c, i) for c in out.outputs for i, t in enumerate(c.inputs) if t is out and not int64_slot(c, i)
                         and not (c.op == "Cast" and c.attrs.get("to") == onnx.TensorProto.INT32)]
            if not data_uses:
                continue
            misses.append(Miss(node.name, f"{node.op} output '{out.name}' is int64 by definition; cast to int32 after it"))
            cast = Emit(graph, node.name).Cast(out, to=onnx.TensorProto.INT32, _dtype=np.int32, _shape=out.shape)
            for c, i in data_uses:
                c.inputs[i] = cast
                touched.append(c)
            n += 1
    return n


def _restore_int64_slots(graph: gs.Graph, names: gu.Names, misses: list[Miss]) -> int:
    """A runtime tensor at an int64-only operand gets a Cast(to=INT64) in front (and a Miss)."""
    n = 0
    for node in list(graph.nodes):
        for i, t in enumerate(node.inputs):
            if int64_slot(node, i) and isinstance(t, gs.Variable) and not t.is_empty() and not _is_i64(t):
                misses.append(Miss(node.name, f"runtime operand '{t.name}' of {node.op} must be int64 (only constants fold away)"))
                node.inputs[i] = Emit(graph, node.name).Cast(t, to=onnx.TensorProto.INT64, _dtype=np.int64, _shape=t.shape)
                n += 1
    return n


def _drop_noop_casts(graph: gs.Graph) -> int:
    n = 0
    inputs, outputs = {id(t) for t in graph.inputs}, {id(t) for t in graph.outputs}
    for node in list(graph.nodes):
        if node.op == "Cast" and node.outputs and id(node.outputs[0]) not in inputs:
            src = gu.dtype_of(node.inputs[0])
            if src is not None and src == onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"]):
                gu.bypass(graph, node, outputs=outputs)
                n += 1
    return n


def _feeds_slot(t: gs.Tensor):
    for c in t.outputs:
        for i, x in enumerate(c.inputs):
            if x is t:
                yield int64_slot(c, i)
