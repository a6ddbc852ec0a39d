"""contrib-ops: onnxruntime contrib (com.microsoft) ops the SDK table lacks, as plain ONNX ops.

onnxruntime's optimizer (and onnxscript's ort_fusions) fuse the tied lm_head into

    FusedMatMul(A, B, alpha, transA, transB, transBatchA, transBatchB):
        Y = alpha * op(A) @ op(B)
        op(X) = X with its dims permuted: transBatch moves dim 0 behind the batch dims
                ([M, b.., K] -> [b.., M, K]), then trans swaps the last two

which no NeuroPilot table has, so the logits MatMul would run on the CPU. Emitted:

    A ─ [Transpose(permA)] ─┐
                            MatMul ─ [Mul(alpha)] ─ Y      (Y keeps its name and consumers)
    B ─ [Transpose(permB)] ─┘

A constant B (the [V, H] embedding table) leaves a `Transpose(W)` that `fold` then handles
(runs before it). Refused (Miss): a transposed operand of unknown rank or rank < 2, transBatch
without two operands of the same rank >= 3 (onnxruntime rejects it too), alpha != 1 with no float
dtype known for Y. An op the table supports is left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

MS = "com.microsoft"


def permutation(rank: int, trans: bool, batch: bool) -> list[int]:
    """FusedMatMul's view of an operand of `rank` dims as a Transpose perm (identity: none)."""
    perm = list(range(rank))
    if batch:
        perm = perm[1:rank - 1] + [0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def _rank(t: gs.Tensor) -> int | None:
    return len(t.shape) if t.shape is not None else None


def _fused_matmul(graph: gs.Graph, node: gs.Node, names: gu.Names) -> str | None:
    """Decompose one FusedMatMul in place; returns the refusal reason instead when it cannot."""
    a, b = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    flag = {k: bool(node.attrs.get(k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")}
    alpha = float(node.attrs.get("alpha", 1.0))
    ranks = {"A": _rank(a), "B": _rank(b)}
    if flag["transBatchA"] or flag["transBatchB"]:
        if ranks["A"] is None or ranks["A"] != ranks["B"] or ranks["A"] < 3:
            return f"transBatch needs A and B of one rank >= 3 (ranks {ranks['A']}, {ranks['B']})"
    perms = {}
    for side in ("A", "B"):
        if not (flag[f"trans{side}"] or flag[f"transBatch{side}"]):
            continue
        if ranks[side] is None or ranks[side] < 2:
            return f"trans{side} on operand {side} of {'unknown rank' if ranks[side] is None else f'rank {ranks[side]}'}"
        perms[side] = permutation(ranks[side], flag[f"trans{side}"], flag[f"transBatch{side}"])
    dtype = gu.dtype_of(y) or gu.dtype_of(a)
    if alpha != 1.0 and (dtype is None or dtype.kind != "f"):
        return f"alpha={alpha} and no float dtype known for '{y.name}'"

    def transposed(x: gs.Tensor, side: str) -> gs.Tensor:
        if side not in perms:
            return x
        shape = None if x.shape is None else [x.shape[i] for i in perms[side]]
        return gu.add_node(graph, names, node, "Transpose", [x], dtype=x.dtype, shape=shape,
                           attrs={"perm": perms[side]}, suffix=f"transpose_{side}")

    inputs = [transposed(a, "A"), transposed(b, "B")]
    node.outputs.clear()
    if alpha != 1.0:
        product = gu.add_node(graph, names, node, "MatMul", inputs, dtype=y.dtype, shape=y.shape)
        scale = gu.make_constant(names.new(f"{node.name}/alpha"), alpha, dtype)
        graph.nodes.append(gs.Node("Mul", names.node(node, "Mul"), inputs=[product, scale], outputs=[y]))
    else:
        graph.nodes.append(gs.Node("MatMul", names.node(node, "MatMul"), inputs=inputs, outputs=[y]))
    node.inputs.clear()
    return None


DECOMPOSE = {"FusedMatMul": _fused_matmul}


@register
class ContribOps(Pass):
    name = "contrib-ops"
    description = "com.microsoft ops the SDK table lacks (FusedMatMul) -> ONNX ops (MatMul, Transpose, Mul)"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        sites = [n for n in graph.nodes if n.domain == MS and n.op in DECOMPOSE
                 and not (ctx.table is not None and ctx.table.has_op(MS, n.op))]
        if not sites:
            return result
        names = gu.Names(graph, self.name)
        for node in sites:
            why = DECOMPOSE[node.op](graph, node, names)
            if why is None:
                result.rewrites += 1
            else:
                result.misses.append(Miss(node.name, why))
        return result
