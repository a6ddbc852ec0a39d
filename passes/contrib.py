"""contrib-ops: onnxruntime contrib (com.microsoft) ops the SDK table lacks, as plain ONNX ops.

onnxruntime's optimizer (and onnxscript's ort_fusions) fuse the tied lm_head into

    FusedMatMul(A, B, alpha, transA, transB, transBatchA, transBatchB):
        Y = alpha * op(A) @ op(B)
        op(X) = X with its dims permuted: transBatch moves dim 0 behind the batch dims
                ([M, b.., K] -> [b.., M, K]), then trans swaps the last two

which no NeuroPilot table has, so the logits MatMul would run on the CPU. Emitted:

    A ─ [Transpose(permA)] ─┐
                            MatMul ─ [Mul(alpha)] ─ Y      (replaces Y; a graph output keeps its name)
    B ─ [Transpose(permB)] ─┘

A constant B (the [V, H] embedding table) leaves a `Transpose(W)` that `fold` then handles
(runs before it). Refused (Miss): a transposed operand of unknown rank or rank < 2, transBatch
without two operands of the same rank >= 3 (onnxruntime rejects it too), alpha != 1 with no float
dtype known for Y. An op the table supports is left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import dtype_of
from mtkc.rewrite.pass_api import register
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule, RulePass

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


def _perms(node: gs.Node) -> dict[int, list[int]]:
    """{operand index: Transpose perm} for the transposed operands, or Refused."""
    a, b = node.inputs[0], node.inputs[1]
    flag = {k: bool(node.attrs.get(k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")}
    ranks = {"A": _rank(a), "B": _rank(b)}
    if flag["transBatchA"] or flag["transBatchB"]:
        if ranks["A"] is None or ranks["A"] != ranks["B"] or ranks["A"] < 3:
            raise Refused(f"transBatch needs A and B of one rank >= 3 (ranks {ranks['A']}, {ranks['B']})")
    perms = {}
    for i, side in enumerate("AB"):
        if not (flag[f"trans{side}"] or flag[f"transBatch{side}"]):
            continue
        if ranks[side] is None or ranks[side] < 2:
            raise Refused(f"trans{side} on operand {side} of "
                          f"{'unknown rank' if ranks[side] is None else f'rank {ranks[side]}'}")
        perms[i] = permutation(ranks[side], flag[f"trans{side}"], flag[f"transBatch{side}"])
    return perms


class FusedMatMul(Rule):
    anchor, sites = (f"{MS}::FusedMatMul",), "FusedMatMul"

    def done(self, ctx, m):
        return ctx.table is not None and ctx.table.has_op(MS, "FusedMatMul")

    def check(self, ctx, m):
        node = m["node"]
        _perms(node)
        alpha, dtype = float(node.attrs.get("alpha", 1.0)), dtype_of(node.outputs[0]) or dtype_of(node.inputs[0])
        if alpha != 1.0 and (dtype is None or dtype.kind != "f"):
            raise Refused(f"alpha={alpha} and no float dtype known for '{node.outputs[0].name}'")

    def rewrite(self, op, ctx, m):
        node = m["node"]
        perms, y = _perms(node), node.outputs[0]
        inputs = []
        for i, x in enumerate(node.inputs[:2]):
            if i in perms:
                shape = None if x.shape is None else [x.shape[p] for p in perms[i]]
                x = op.Transpose(x, perm=perms[i], _dtype=x.dtype, _shape=shape)
            inputs.append(x)
        product = op.MatMul(*inputs, _dtype=y.dtype, _shape=y.shape)
        alpha = float(node.attrs.get("alpha", 1.0))
        if alpha != 1.0:
            dtype = dtype_of(y) or dtype_of(node.inputs[0])
            product = op.Mul(product, op.const("alpha", np.array(alpha, dtype)), _dtype=y.dtype, _shape=y.shape)
        return [(y, product)]


@register
class ContribOps(RulePass):
    name = "contrib-ops"
    description = "com.microsoft ops the SDK table lacks (FusedMatMul) -> ONNX ops (MatMul, Transpose, Mul)"
    before = ("fold",)  # a constant operand's Transpose is folded
    rules = (FusedMatMul(),)
