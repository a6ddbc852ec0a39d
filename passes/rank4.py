"""rank4: rank-5+ tensors rewritten as rank 4 by merging two adjacent axes (MDLA limit: rank <= 4).

GQA repeat_kv is the case every Qwen/Llama export has:

    K [B,Hkv,S,D] -Unsqueeze(2)-> [B,Hkv,1,S,D] -Expand-> [B,Hkv,n,S,D] -Reshape-> [B,Hkv*n,S,D]
  becomes
    K [B,Hkv,S,D] -Reshape-> [B,Hkv,1,S*D]   -Expand-> [B,Hkv,n,S*D]   -Reshape-> [B,Hkv*n,S,D]

Generic rule: a *region* is a connected set of rank-r (r >= 5) tensors with
  entries   Unsqueeze/Reshape from rank <= 4          -> Reshape to the merged shape
  interior  Expand, Tile, elementwise ops (broadcast),  -> same op on merged shapes
            per-tensor Quantize/DequantizeLinear (QDQ models)
  exits     Reshape/Squeeze/Flatten to rank <= 4      -> Reshape from the merged shape
Axes (i, i+1) merge when every interior node broadcasts/tiles them together (both equal to the
output, or both 1, or one output dim 1); pairs are tried trailing first, then leading. Merging
repeats until the region is rank 4. Row-major order is unchanged, so values are bit-identical.
Refuses (Miss): a rank-5 graph input/output, an op not listed above on a rank-5 tensor (e.g.
GatherND, MatMul, Transpose), non-static shapes, or no mergeable pair.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.ir.constants import ints, values
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater",
               "GreaterOrEqual", "And", "Or", "Xor", "Not", "Neg", "Cast", "Sigmoid", "Tanh", "Exp", "Sqrt", "Abs",
               "Reciprocal", "Relu", "Erf", "Identity", "IsNaN", "Sin", "Cos", "Mod"}
QDQ = {"QuantizeLinear", "DequantizeLinear"}  # a QDQ model's Q/DQ on each activation, per-tensor
ENTRIES = {"Unsqueeze", "Reshape"}
EXITS = {"Reshape", "Squeeze", "Flatten"}
MAX_RANK = 4


@register
class Rank4(Pass):
    name = "rank4"
    description = "rank-5+ tensors (GQA repeat_kv, elementwise chains) rewritten as rank 4 by merging axes"

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        names = gu.Names(graph)
        io = {id(t) for t in (*graph.inputs, *graph.outputs)}
        seen: set[int] = set()
        for t in list(gu.tensor_map(graph).values()):
            if id(t) in seen or not _high(t):
                continue
            if isinstance(t, gs.Constant):
                for node in t.outputs:
                    if node.op not in ELEMENTWISE:
                        result.misses.append(Miss(node.name, f"rank-{len(t.shape)} constant operand '{t.name}' of {node.op}"))
                continue
            region = _region(graph, t)
            seen.update(id(x) for x in region.tensors)
            reason = region.refusal(io)
            while reason is None and region.rank > MAX_RANK:
                pair = region.mergeable_pair()
                if pair is None:
                    reason = f"no pair of adjacent axes merges in all {len(region.nodes)} nodes"
                    break
                region.merge(pair, names)
                result.rewrites += 1
            if reason:
                result.misses.append(Miss(region.culprit or t.name, reason))
        return result


def _high(t: gs.Tensor) -> bool:
    return t.shape is not None and len(t.shape) > MAX_RANK


class Region:
    """Connected rank-r tensors and the nodes that produce or consume them."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.tensors: list[gs.Tensor] = []
        self.nodes: list[gs.Node] = []
        self.culprit: str | None = None

    @property
    def rank(self) -> int:
        return len(self.tensors[0].shape)

    def refusal(self, io: set[int]) -> str | None:
        r = self.rank
        for t in self.tensors:
            if id(t) in io:
                self.culprit = t.name
                return f"rank-{len(t.shape)} tensor '{t.name}' is a graph input/output"
            if len(t.shape) != r or gu.static_shape(t) is None:
                self.culprit = t.name
                return f"tensor '{t.name}' shape {t.shape} is not a static rank-{r} shape"
        for node in self.nodes:
            kind = self.kind(node)
            if kind is None:
                self.culprit = node.name
                return f"{node.op} on a rank-{r} tensor has no rank-4 rule"
            if kind in ("expand", "tile") and ints(node.inputs[1]) is None:
                self.culprit = node.name
                return f"{node.op} with a non-constant shape operand"
        return None

    def kind(self, node: gs.Node) -> str | None:
        high_in = any(_high(t) for t in node.inputs[:1])
        high_out = any(_high(t) for t in node.outputs)
        if node.domain not in (None, "", "ai.onnx") or len(node.outputs) != 1:
            return None
        if node.op in ENTRIES and high_out and not high_in:
            return "entry"
        if node.op in EXITS and high_in and not high_out:
            return "exit"
        if not high_out:
            return None
        if node.op == "Expand":
            return "expand"
        if node.op == "Tile":
            return "tile"
        if node.op in ELEMENTWISE:
            return "elementwise"
        if node.op in QDQ and all(isinstance(t, gs.Constant) and t.values.size == 1 for t in node.inputs[1:]):
            return "qdq"  # per-tensor: shape-agnostic, like an elementwise op with scalar operands
        return None

    def mergeable_pair(self) -> tuple[int, int] | None:
        r = self.rank
        for i in [r - 2, *range(0, r - 2)]:
            if all(self._merges(node, i) for node in self.nodes):
                return i, i + 1
        return None

    def _merges(self, node: gs.Node, i: int) -> bool:
        kind = self.kind(node)
        if kind in ("entry", "exit", "qdq"):
            return True
        out = gu.static_shape(node.outputs[0])
        if kind == "tile":
            reps, x = ints(node.inputs[1]), _aligned(node.inputs[0], len(out))
            return reps[i + 1] == 1 or x[i] == 1
        for t in (node.inputs[:1] if kind == "expand" else node.inputs):
            x = _aligned(t, len(out))
            if x is None:
                return False
            same = x[i] == out[i] and x[i + 1] == out[i + 1]
            ones = x[i] == 1 and x[i + 1] == 1
            if not (same or ones or out[i] == 1 or out[i + 1] == 1):
                return False
        return True

    def merge(self, pair: tuple[int, int], names: gu.Names) -> None:
        i = pair[0]
        for node in self.nodes:
            kind = self.kind(node)
            out = node.outputs[0]
            if kind == "entry":
                _to_reshape(node, node.inputs[0], _merged(gu.static_shape(out), i), names)
            elif kind == "exit":
                _to_reshape(node, node.inputs[0], gu.static_shape(out), names)
            elif kind == "expand":
                gu.set_input(node, 1, gu.make_constant(names.new(f"{node.name}/shape"), _merged(gu.static_shape(out), i),
                                                       np.int64))
            elif kind == "tile":
                reps = ints(node.inputs[1])
                merged = reps[:i] + [reps[i] * reps[i + 1]] + reps[i + 2:]
                gu.set_input(node, 1, gu.make_constant(names.new(f"{node.name}/repeats"), merged, np.int64))
            elif kind == "elementwise":
                rank = len(out.shape)
                for k, t in enumerate(node.inputs):
                    if isinstance(t, gs.Constant) or not _high(t):
                        gu.set_input(node, k, _lowered_operand(self.graph, t, rank, i, node, names))
        for t in self.tensors:
            t.shape = list(_merged(gu.static_shape(t), i))


def _region(graph: gs.Graph, start: gs.Tensor) -> Region:
    """Flood the connected rank-r tensors (through producer and consumer nodes)."""
    region, stack, seen_t, seen_n = Region(graph), [start], set(), set()
    while stack:
        t = stack.pop()
        if id(t) in seen_t:
            continue
        seen_t.add(id(t))
        region.tensors.append(t)
        for node in [*t.inputs, *t.outputs]:
            if id(node) in seen_n:
                continue
            seen_n.add(id(node))
            region.nodes.append(node)
            for x in [*node.inputs, *node.outputs]:
                if _high(x) and not isinstance(x, gs.Constant) and id(x) not in seen_t:
                    stack.append(x)
    return region


def _aligned(t: gs.Tensor, rank: int) -> list[int] | None:
    shape = gu.static_shape(t)
    return None if shape is None else [1] * (rank - len(shape)) + list(shape)


def _merged(shape, i: int) -> list[int]:
    shape = list(shape)
    return shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]


def _to_reshape(node: gs.Node, x: gs.Tensor, shape, names: gu.Names) -> None:
    node.op, node.attrs = "Reshape", {}
    const = gu.make_constant(names.new(f"{node.name}/shape"), list(shape), np.int64)
    gu.clear_inputs(node)  # its shape operand may be a constant hundreds of nodes read
    node.inputs.extend([x, const])


def _lowered_operand(graph: gs.Graph, t: gs.Tensor, rank: int, i: int, node: gs.Node, names: gu.Names) -> gs.Tensor:
    """A lower-rank operand of an elementwise op, reshaped so it broadcasts like before the merge.

    Constants are reshaped directly; a runtime operand gets a Reshape only when the merged axes
    reach its own (not broadcast-padded) axes.
    """
    aligned = _aligned(t, rank)
    if isinstance(t, gs.Constant):
        return gu.make_constant(names.new(f"{t.name}/rank4"), values(t).reshape(_merged(aligned, i)))
    if i < rank - len(t.shape):
        return t
    shape = _merged(aligned, i)
    op = Emit(graph, node.name)
    return op.Reshape(t, op.ints("operand_shape", *shape), _dtype=t.dtype, _shape=shape)
