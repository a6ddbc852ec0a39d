"""opset17: rewrite an opset 18+ graph (dynamo exports are opset 20) to ONNX opset 17.

    Split(x, num_outputs=n)                 -> Split(x, split=[sizes] input)       (18)
    Reshape(x, shape, allowzero=1)          -> Reshape(x, shape), shape has no 0   (14, dropped 18 use)
    ReduceMean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare(x, axes input)
                                            -> Reduce*(x, axes=[...] attribute)    (18)
    Reduce*(x, noop_with_empty_axes=1) without axes -> Identity                    (18)
    Pad(x, pads, value, axes)               -> Pad(x, pads over every axis, value) (18)
    Cast/CastLike(saturate=1)               -> without the attribute               (19)
    graph opset                             -> 17 (ai.onnx import too)

Older graphs (opset 14..16) only get their opset raised: nothing in these exports changed
meaning between 14 and 17. Refuses (Miss): non-constant axes/pads, a zero in an allowzero
shape, an op that has no opset-17 form (RMSNormalization, RotaryEmbedding, Attention, Gelu
... are other passes' work). With any refusal the opset is left unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register
from mtkc.target.onnx_opset import NEW_AFTER_17, NPU_OPSET, import_domains

TARGET = NPU_OPSET
REDUCE_18 = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
             "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}


@register
class Opset17(Pass):
    name = "opset17"
    description = "rewrite opset 18+ forms (Split num_outputs, Reduce axes inputs, allowzero, ...) and set opset 17"

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        if graph.opset == TARGET:
            return result
        if graph.opset < TARGET:
            _set_opset(graph)
            result.rewrites = 1
            result.notes.append(f"opset raised to {TARGET}")
            return result
        names = gu.Names(graph, self.name)
        for node in list(graph.nodes):
            if node.domain not in (None, "", "ai.onnx"):
                continue
            reason = _lower(graph, node, ctx, names)
            if reason is True:
                result.rewrites += 1
            elif reason:
                result.misses.append(Miss(node.name, reason))
        if result.misses:
            result.notes.append(f"opset left at {graph.opset}: {len(result.misses)} node(s) have no opset-{TARGET} form")
            return result
        _set_opset(graph)
        result.rewrites += 1
        return result


def _set_opset(graph: gs.Graph) -> None:
    """New opset ids, not edited in place: they are the parsed file's, which other graphs share."""
    graph.opset = TARGET
    if graph.import_domains:
        graph.import_domains = import_domains(graph.import_domains)


def _lower(graph: gs.Graph, node: gs.Node, ctx: Context, names: gu.Names):
    """True when rewritten, a reason when refused, None when already valid at opset 17."""
    op = node.op
    if op in NEW_AFTER_17:
        return f"{op} does not exist in opset {TARGET} (needs its own decomposition pass)"
    if op == "Split" and "num_outputs" in node.attrs:
        return _split(node, names)
    if op == "Reshape" and node.attrs.get("allowzero", 0) == 1:
        shape = gu.ints(node.inputs[1], ctx)
        if shape is None:
            return "allowzero=1 with a non-constant shape"
        if 0 in shape:
            return "allowzero=1 with a 0 in the shape"
        del node.attrs["allowzero"]
        return True
    if op in REDUCE_18:
        return _reduce(node, ctx)
    if op == "Pad" and len(node.inputs) > 3 and not node.inputs[3].is_empty():
        return _pad(node, ctx, names)
    if op in ("Cast", "CastLike") and "saturate" in node.attrs:
        del node.attrs["saturate"]
        return True
    return None


def _split(node: gs.Node, names: gu.Names):
    n = node.attrs["num_outputs"]
    axis = node.attrs.get("axis", 0)
    shape = gu.static_shape(node.inputs[0])
    if shape is None:
        return "Split num_outputs on a tensor without a static shape"
    dim = shape[axis]
    chunk = -(-dim // n)
    sizes = [min(chunk, dim - i * chunk) for i in range(n)]
    del node.attrs["num_outputs"]
    node.inputs.append(gu.make_constant(names.new(f"{node.name}/split"), sizes, np.int64))
    return True


def _reduce(node: gs.Node, ctx: Context):
    noop = node.attrs.pop("noop_with_empty_axes", 0)
    has_axes = len(node.inputs) > 1 and not node.inputs[1].is_empty()
    if not has_axes:
        if noop:
            node.op, node.attrs = "Identity", {}
        return True if noop else None
    axes = gu.ints(node.inputs[1], ctx)
    if axes is None:
        node.attrs["noop_with_empty_axes"] = noop
        return "axes input is not a constant"
    if not axes and noop:
        node.op, node.attrs = "Identity", {}
    elif axes:
        node.attrs["axes"] = axes
    gu.keep_inputs(node, 1)
    return True


def _pad(node: gs.Node, ctx: Context, names: gu.Names):
    axes, pads = gu.ints(node.inputs[3], ctx), gu.ints(node.inputs[1], ctx)
    shape = node.inputs[0].shape
    if axes is None or pads is None or shape is None:
        return "Pad axes/pads are not constants or the rank is unknown"
    rank = len(shape)
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        a %= rank
        full[a], full[rank + a] = pads[i], pads[len(axes) + i]
    node.inputs[1] = gu.make_constant(names.new(f"{node.name}/pads"), full, np.int64)
    gu.keep_inputs(node, 3)
    return True
