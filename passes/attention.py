"""Attention: scaled dot-product attention as MatMul / Mul / Add / Softmax / MatMul, 4-D only.

No SDK table has a fused attention op, so every form ends as

    Q ─ Mul(1/√d) ─┐
    Kᵀ ────────────┴─ MatMul ─ Add(mask) ─ Softmax(-1) ─┐
    V ──────────────────────────────────────────────────┴─ MatMul

Rules, in order:
    FusedAttention  (attention_fused.py) MultiHeadAttention, GroupQueryAttention, Attention-23
    Scores          anchor: each Softmax; its scores are one of
                      MatMul(Mul(Q, √s), Mul(Kᵀ, √s))   (SDPA export) -> MatMul(Mul(Q, s), Kᵀ)
                      Mul(MatMul(Q, Kᵀ), s) | Div(MatMul(Q, Kᵀ), √d) | MatMul(Q, Kᵀ)  (canonical)
                    optionally + Add(mask); and the SDPA export's 3-D Kᵀ trick
                      Reshape(Transpose(Reshape(K, [-1,T,D]), [0,2,1]), [B,H,D,T]) -> Transpose(K, [0,1,3,2])
    RowGuard        anchor: each Where that only zeroes fully-masked rows (mtkc.rewrite.guards):
                    Where(IsNaN(P), 0, P) -> P;  Where(Less(ReduceSum(mask), 1), 0, O) -> O
                    (a finite additive mask has no fully-masked row)
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import static_shape
from mtkc.passes.attention_fused import FusedAttention
from mtkc.rewrite.guards import guarded
from mtkc.rewrite.pass_api import register
from mtkc.rewrite.pattern import Const, Or, Refused, Var
from mtkc.rewrite.rules import Rule, RulePass


def _last(axis) -> bool:
    """-1 (the last axis)"""
    return axis in (-1, 3, None)


def _scalar(v) -> None:
    if v.size != 1:
        raise Refused(f"scale has {v.size} values")


class Scores(Rule):
    anchor, sites = ("Softmax",), "attention"

    def pattern(self, op):
        q, kt = Var("q"), Var("kt")
        scores = Or(op.MatMul(op.Mul(q, Const("sq", check=_scalar), _name="mul_q"),
                              op.Mul(kt, Const("sk", check=_scalar), _name="mul_k"), _name="qk"),
                    op.Mul(op.MatMul(q, kt, _name="qk"), Const("s", check=_scalar)),
                    op.Div(op.MatMul(q, kt, _name="qk"), Const("s", check=_scalar)),
                    op.MatMul(q, kt, _name="qk"))
        return op.Softmax(Or(op.Add(scores, Var("mask"), _name="add_mask", _commute=False), scores), axis=_last,
                          _name="softmax")

    def done(self, ctx, m):
        return "sq" not in m.bindings and _k_of(m["kt"]) is None

    def rewrite(self, op, ctx, m):
        replaced = []
        if "sq" in m.bindings:  # MatMul(Mul(Q, a), Mul(Kᵀ, b)) -> MatMul(Mul(Q, a*b), Kᵀ)
            q, out = m["q"], m["qk"].outputs[0]
            scale = float(m.value("sq").reshape(-1)[0]) * float(m.value("sk").reshape(-1)[0])
            replaced.append((out, op.MatMul(op.Mul(q, op.scalar("scale", scale, q), _shape=q.shape), m["kt"])))
        kt, k = m["kt"], _k_of(m["kt"])
        if k is not None:
            b, h, d, t = kt.shape
            if list(k.shape) != [b, h, t, d]:  # e.g. the 5-D GQA repeat folded into this Reshape
                k = op.Reshape(k, op.ints("shape", b, h, t, d), _dtype=kt.dtype, _shape=[b, h, t, d])
            replaced.append((kt, op.Transpose(k, perm=[0, 1, 3, 2], _dtype=kt.dtype)))
        return replaced


def _k_of(kt: gs.Tensor) -> gs.Tensor | None:
    """K of Kᵀ = Reshape(Transpose(Reshape(K, [-1,T,D]), [0,2,1]), [B,H,D,T]) with static shapes, else None."""
    outer = kt.inputs[0] if len(kt.inputs) == 1 else None
    if outer is None or outer.op != "Reshape" or not outer.inputs[0].inputs:
        return None
    mid = outer.inputs[0].inputs[0]
    if mid.op != "Transpose" or list(mid.attrs.get("perm", [])) != [0, 2, 1] or not mid.inputs[0].inputs:
        return None
    inner = mid.inputs[0].inputs[0]
    if inner.op != "Reshape":
        return None
    k, flat = inner.inputs[0], inner.outputs[0]
    shapes = [static_shape(t) for t in (k, kt, flat)]
    if None in shapes or len(shapes[1]) != 4 or len(shapes[2]) != 3:
        return None
    b, h, d, t = shapes[1]
    return k if list(shapes[2]) == [b * h, t, d] and list(shapes[0][-2:]) == [t, d] else None


class RowGuard(Rule):
    anchor, sites = ("Where",), "row guard"

    def candidate(self, node):
        return guarded(node) is not None

    def start(self, graph, ctx):
        self.outputs = {id(t) for t in graph.outputs}  # no rewrite of this rule touches them (see `done`)

    def done(self, ctx, m):
        return id(m["node"].outputs[0]) in self.outputs  # kept: it names a graph output

    def rewrite(self, op, ctx, m):
        return [(m["node"].outputs[0], guarded(m["node"]))]


@register
class Attention(RulePass):
    name = "attention"
    description = "Attention to MatMul/Mul/Add/Softmax/MatMul: one scale Mul, no NaN guards, fused ops decomposed"
    rules = (FusedAttention(), Scores(), RowGuard())

