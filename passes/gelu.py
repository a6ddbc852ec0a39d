"""Gelu (ONNX opset 20; dynamo exports of Gemma's GeGLU MLP) in the opset-17 primitives the SDK runs.

Matched (rule Decompose, anchor: each Gelu):

    Gelu(x, approximate="tanh")  =>  0.5·x·(1 + Tanh(√(2/π)·(x + 0.044715·x·x·x)))
    Gelu(x, approximate="none")  =>  0.5·x·(1 + Erf(x·1/√2))

Gelu exists only from opset 20, so left alone it has no opset-17 form: it would run on the CPU and
keep the whole graph at opset 20. The tanh form is MediaTek's GELU_V2 (the converter fuses it back
where the SDK has the op); the erf form's Erf runs wherever the table says (SDK 6.0: CPU, with the
table's reason). Runs before `opset17`, so that pass can lower the graph. Refused: an unknown
`approximate` value.
"""

from __future__ import annotations

import math

from mtkc.rewrite.pass_api import register
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule, RulePass


class Decompose(Rule):
    anchor, sites = ("Gelu",), "Gelu"

    def check(self, ctx, m):
        approximate = m["node"].attrs.get("approximate", "none")
        if approximate not in ("tanh", "none"):
            raise Refused(f"Gelu approximate={approximate!r}", m["node"])

    def rewrite(self, op, ctx, m):
        node = m["node"]
        x = node.inputs[0]
        kw = dict(_dtype=x.dtype, _shape=x.shape)
        if node.attrs.get("approximate", "none") == "tanh":
            cube = op.Mul(op.Mul(x, x, **kw), x, **kw)
            inner = op.Mul(op.Add(x, op.Mul(cube, op.scalar("c", 0.044715, x), **kw), **kw),
                           op.scalar("sqrt_2_pi", math.sqrt(2 / math.pi), x), **kw)
            gate = op.Tanh(inner, **kw)
        else:
            gate = op.Erf(op.Mul(x, op.scalar("inv_sqrt2", 1 / math.sqrt(2), x), **kw), **kw)
        half = op.Mul(x, op.scalar("half", 0.5, x), **kw)
        return [(node.outputs[0], op.Mul(half, op.Add(gate, op.scalar("one", 1.0, x), **kw), **kw))]


@register
class Gelu(RulePass):
    name = "gelu"
    description = "Gelu (opset 20) -> Tanh/Erf primitives in opset 17 (Gemma's GeGLU from dynamo exports)"
    rules = (Decompose(),)
