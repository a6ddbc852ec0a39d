"""SwiGLU: the gated MLP's SiLU in the form every SDK table has (Sigmoid then Mul), canonical order.

    y = silu(gate) * up,   silu(g) = g * sigmoid(g)

Matched (rule Gated, anchor: each Sigmoid and each fused activation node):

    gate ─┬─ Sigmoid ─┐
          └───────────┴─ Mul ─┐
    up ───────────────────────┴─ Mul          (either operand order in both Muls)

    com.microsoft QuickGelu(alpha=1)  (onnxruntime's Sigmoid+Mul fusion)  ─ Mul(·, up)
    Swish(alpha=1) (opset 24)                                            ─ Mul(·, up)

Emitted: Mul(gate, Sigmoid(gate)) then Mul(silu, up). With option `merge_gate_up` (off by default;
it reads both weights, rule MergeGateUp) the two projections of the same input, MatMul(x, Wg) and
MatMul(x, Wu) with constant [H, I] weights, become one MatMul(x, Concat(Wg, Wu)) + Split([I, I]).
Refused: a gate and an up that are the same tensor, a SiLU whose alpha is not 1.
"""

from __future__ import annotations

import numpy as np

from mtkc.ir.constants import close, constant_of, values
from mtkc.rewrite.pass_api import register
from mtkc.rewrite.pattern import Or, Refused, Var
from mtkc.rewrite.rules import Rule, RulePass

MS = "com.microsoft"


def _alpha_one(alpha) -> bool:
    """alpha == 1"""
    return alpha is None or close(np.asarray(alpha), 1.0)


def _gated(op):
    gate = Var("gate")
    silu = Or(op.Mul(gate, op.Sigmoid(gate), _name="silu"),
              op.QuickGelu(gate, alpha=_alpha_one, _domain=MS, _name="silu"),
              op.Swish(gate, alpha=_alpha_one, _name="silu"))
    return op.Mul(silu, Var("up"), _name="out")


class Gated(Rule):
    anchor, root, steps, sites = ("Sigmoid", f"{MS}::QuickGelu", "Swish"), "Mul", 2, "SwiGLU"

    def pattern(self, op):
        return _gated(op)

    def check(self, ctx, m):
        if m["gate"] is m["up"]:
            raise Refused("gate and up are the same tensor (x * silu(x) is not a gated MLP)")

    def done(self, ctx, m):
        silu, out = m["silu"], m["out"]
        return silu.op == "Mul" and silu.inputs[0] is m["gate"] and out.inputs[0] is silu.outputs[0]

    def rewrite(self, op, ctx, m):
        gate, up = m["gate"], m["up"]
        silu = op.Mul(gate, op.Sigmoid(gate, _dtype=gate.dtype, _shape=gate.shape), _dtype=gate.dtype, _shape=gate.shape)
        return [(m["out"].outputs[0], op.Mul(silu, up))]


class MergeGateUp(Rule):
    """MatMul(x, Wg), MatMul(x, Wu) -> Split(MatMul(x, Concat(Wg, Wu))), on Gated's sites."""

    anchor, root, steps, sites, quiet = Gated.anchor, "Mul", 2, "gate/up merge", True

    def applies(self, ctx):
        return bool(ctx.options.merge_gate_up)

    def pattern(self, op):
        return _gated(op)

    def done(self, ctx, m):
        """Not a gated MLP (Gated says why), or gate and up already come out of one Split."""
        gate, up = m["gate"].inputs, m["up"].inputs
        return m["gate"] is m["up"] or (len(gate) == 1 and len(up) == 1 and gate[0] is up[0] and gate[0].op == "Split")

    def check(self, ctx, m):
        if self.done(ctx, m):
            return
        gate_mm, up_mm = (m[k].inputs[0] if len(m[k].inputs) == 1 else None for k in ("gate", "up"))
        if gate_mm is None or up_mm is None or gate_mm.op != "MatMul" or up_mm.op != "MatMul":
            raise Refused("gate/up merge: gate and up are not both MatMul outputs")
        if gate_mm.inputs[0] is not up_mm.inputs[0]:
            raise Refused("gate/up merge: gate and up project different inputs")
        wg, wu = constant_of(gate_mm.inputs[1]), constant_of(up_mm.inputs[1])
        if wg is None or wu is None or len(wg.shape) != 2 or tuple(wg.shape) != tuple(wu.shape):
            raise Refused("gate/up merge: weights are not constant [H, I] matrices of one shape")
        if len(m["gate"].outputs) != 2 or len(m["up"].outputs) != 1:  # gate feeds Sigmoid and Mul only
            raise Refused("gate/up merge: gate or up has other consumers")

    def prefix(self, m):
        return m["gate"].inputs[0].name

    def rewrite(self, op, ctx, m):
        gate, up = m["gate"], m["up"]
        gate_mm, up_mm = gate.inputs[0], up.inputs[0]
        wg, wu = (values(mm.inputs[1], ctx.read_values) for mm in (gate_mm, up_mm))
        both = op.MatMul(gate_mm.inputs[0], op.const("gate_up", np.concatenate([wg, wu], axis=1)), _dtype=gate.dtype)
        inter = wg.shape[1]
        new_gate, new_up = op.Split(both, op.ints("sizes", inter, inter), axis=-1, _dtype=gate.dtype, _outputs=2)
        return [(gate, new_gate), (up, new_up)]


@register
class SwiGLU(RulePass):
    name = "swiglu"
    description = "SwiGLU MLP: SiLU as Sigmoid*Mul in canonical order; optional gate/up MatMul merge"
    rules = (Gated(), MergeGateUp())
