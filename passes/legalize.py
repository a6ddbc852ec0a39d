"""legalize: small rewrites into the forms every NeuroPilot tier converts.

    Neg(x)                          -> Mul(x, -1)      (LiteRT's MediaTek plugin has no NEG)
    Pow(x, 2)                       -> Mul(x, x)       (MDLA restricts the POW exponent)
    op(a[r], b[k<r]) elementwise    -> op(a, b') with b' rank r: constants reshaped in place
                                       (external weights keep their bytes), runtime operands
                                       through a static Reshape (MDLA rejects [1,S] * [1,S,1])
    Add(MatMul(A[M,K], W[K,N]), b[N]) -> Gemm(A, W, b) when A is 2-D and the table has Gemm

Refuses (Miss): Pow with another exponent, runtime operands without a static shape, MatMul+bias
pairs whose activation is not 2-D (FULLY_CONNECTED lowering takes them as they are).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.ir.constants import is_lazy, scalar
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
                 "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitShift"}


def has_op(ctx: Context, op: str, domain: str = "") -> bool:
    """The target table lists `op` (no table: assume it does)."""
    table = ctx.table
    return table is None or not hasattr(table, "has_op") or table.has_op(domain, op)


@register
class Legalize(Pass):
    name = "legalize"
    description = "Neg -> Mul(-1), Pow(x,2) -> x*x, equal-rank broadcasting, 2-D MatMul+bias -> Gemm"

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        names = gu.Names(graph)
        for node in list(graph.nodes):
            if node.domain not in (None, "", "ai.onnx") or not node.outputs:
                continue
            if node.op == "Neg":
                result.rewrites += _neg(graph, node)
            elif node.op == "Pow":
                result.rewrites += _pow(node, ctx, result.misses)
        reshaped: dict[tuple, gs.Tensor] = {}
        for node in list(graph.nodes):
            if node.op in BROADCAST_OPS and node.domain in (None, "", "ai.onnx"):
                result.rewrites += _equal_rank(graph, node, names, reshaped, result.misses)
        if has_op(ctx, "Gemm"):
            for node in list(graph.nodes):
                if node.op == "Add":
                    result.rewrites += _gemm(graph, node, ctx, result.misses)
        return result


def _neg(graph: gs.Graph, node: gs.Node) -> int:
    x = node.inputs[0]
    if gu.dtype_of(x) is None or x.shape is None:
        return 0
    gu.replace_uses(graph, node.outputs[0], Emit(graph, node.name).negate(x))
    node.outputs.clear()
    return 1


def _pow(node: gs.Node, ctx: Context, misses: list[Miss]) -> int:
    exponent = scalar(node.inputs[1], ctx.read_values)
    if exponent is None:
        misses.append(Miss(node.name, "exponent is not a constant scalar"))
        return 0
    if exponent != 2.0:
        misses.append(Miss(node.name, f"exponent {exponent} is not 2"))
        return 0
    x = node.inputs[0]
    node.op = "Mul"
    node.inputs[1] = x
    return 1


def _equal_rank(graph: gs.Graph, node: gs.Node, names: gu.Names, reshaped: dict, misses: list[Miss]) -> int:
    """Operands of lower rank than the output get leading 1s (one reshaped copy per operand)."""
    out = node.outputs[0]
    if out.shape is None:
        return 0
    rank = len(out.shape)
    n = 0
    for i, t in enumerate(node.inputs):
        if t.is_empty() or t.shape is None or len(t.shape) >= rank:
            continue
        shape = [1] * (rank - len(t.shape)) + list(t.shape)
        key = (id(t), rank)
        if key in reshaped:
            node.inputs[i] = reshaped[key]
        elif isinstance(t, gs.Constant):
            node.inputs[i] = reshaped[key] = reshaped_constant(t, shape, names)
        elif gu.static_shape(t) is not None:
            op = Emit(graph, node.name)
            node.inputs[i] = reshaped[key] = op.Reshape(t, op.ints(f"rank{rank}", *shape), _dtype=t.dtype, _shape=shape)
        else:
            misses.append(Miss(node.name, f"operand '{t.name}' has rank {len(t.shape)} < {rank} and no static shape"))
            continue
        n += 1
    return n


def reshaped_constant(t: gs.Constant, shape: list[int], names: gu.Names) -> gs.Constant:
    """A constant with the same bytes and a new shape; a lazy (external) one is not read."""
    name = names.new(f"{t.name}/r{len(shape)}")
    if is_lazy(t):
        proto = onnx.TensorProto()
        proto.CopyFrom(t._values.tensor)
        del proto.dims[:]
        proto.dims.extend(shape)
        proto.name = name
        return gs.Constant(name, gs.ir.tensor.LazyValues(proto))
    return gs.Constant(name, np.asarray(t.values).reshape(shape))


def _gemm(graph: gs.Graph, add: gs.Node, ctx: Context, misses: list[Miss]) -> int:
    matmul_out, bias = add.inputs
    if isinstance(matmul_out, gs.Constant):
        matmul_out, bias = bias, matmul_out
    producer = matmul_out.inputs[0] if len(matmul_out.inputs) == 1 else None
    if producer is None or producer.op != "MatMul" or not isinstance(bias, gs.Constant) \
            or not isinstance(producer.inputs[1], gs.Constant):
        return 0
    a, w = producer.inputs
    if a.shape is None or len(a.shape) != 2:
        misses.append(Miss(add.name, f"MatMul activation '{a.name}' is rank {len(a.shape or [])}, Gemm needs 2-D"))
        return 0
    if len(w.shape) != 2 or len(matmul_out.outputs) != 1 or any(t is matmul_out for t in graph.outputs):
        misses.append(Miss(add.name, "MatMul output has other consumers or the weight is not 2-D"))
        return 0
    if tuple(bias.shape) not in ((w.shape[1],), (1, w.shape[1])):
        misses.append(Miss(add.name, f"bias shape {list(bias.shape)} is not [N]"))
        return 0
    add.op, add.attrs = "Gemm", {}
    add.inputs.clear()
    add.inputs.extend([a, w, bias])
    producer.outputs.clear()
    producer.inputs.clear()
    return 1
