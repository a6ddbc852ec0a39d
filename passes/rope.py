"""RoPE: rotate-half with Mul(-1) instead of Neg, fused RoPE ops decomposed, cos/sin hoisted.

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2])

Rules, in order:
    FusedRotary     (rope_fused.py) com.microsoft and opset-23 RotaryEmbedding -> rotate-half
    RotateHalf      anchor: each Neg or float Mul(·, -1):

        x ─┬────────────────────────────────────────── Mul(·, cos) ─┐
           ├─ Slice(D/2:) ─ Neg ─┐                                  ├─ Add
           └─ Slice(:D/2) ───────┴─ Concat(-1) ─────── Mul(·, sin) ─┘

                    emitted: the Neg as Mul(·, -1) (no NeuroPilot tier converts Neg)
    Hoist           (rope_tables.py) Cos/Sin -> a constant table gathered by position, or a pos_emb input
    FoldedToPosEmb  (rope_tables.py) constant cos/sin -> pos_emb slices (rope_mode pos_emb)

`map_feeds` builds pos_emb from the original position_ids (or 0..T-1) with the evaluated tables.
Refused: slices that are not the two halves of the last axis.
"""

from __future__ import annotations

import numpy as np

from mtkc.ir.constants import SMALL, is_scalar, values
from mtkc.passes.rope_fused import FusedRotary
from mtkc.passes.rope_tables import POS_EMB, FoldedToPosEmb, Hoist
from mtkc.rewrite.pass_api import Context, register
from mtkc.rewrite.pattern import Const, Or, Refused, Var
from mtkc.rewrite.rules import Rule, RulePass


def _last_axis(axis) -> bool:
    """-1 (the last axis)"""
    return axis in (-1, 3)


class RotateHalf(Rule):
    anchor, root, steps, sites = ("Neg", "Mul"), "Add", 3, "rotate-half"

    def candidate(self, node):
        return node.op == "Neg" or (len(node.inputs) == 2 and is_scalar(node.inputs[1], -1.0, kinds="f"))

    def pattern(self, op):
        x = Var("x")
        hi = op.Slice(x, _name="hi", _extra=True)
        flip = Or(op.Neg(hi, _name="neg"), op.Mul(hi, Const(value=-1.0), _name="neg"))
        rot = op.Concat(flip, op.Slice(x, _name="lo", _extra=True), axis=_last_axis, _name="rot")
        return op.Add(op.Mul(x, Var("cos")), op.Mul(rot, Var("sin")), _name="add")

    def check(self, ctx, m):
        """The two slices split the last axis at one point (checked when their bounds are constants)."""
        lo, hi = m["lo"], m["hi"]
        bounds = [values(t, max_elements=SMALL) for t in (lo.inputs[1], lo.inputs[2], hi.inputs[1])]
        if any(b is None for b in bounds):
            return  # runtime bounds (TorchScript before folding): structure alone decides
        lo_start, lo_end, hi_start = (int(b.reshape(-1)[0]) for b in bounds)
        if lo_start != 0 or lo_end != hi_start:
            raise Refused(f"slices [{lo_start}:{lo_end}] and [{hi_start}:] are not the two halves")

    def done(self, ctx, m):
        return m["neg"].op != "Neg"

    def prefix(self, m):
        return m["neg"].name

    def rewrite(self, op, ctx, m):
        neg = m["neg"]
        return [(neg.outputs[0], op.negate(neg.inputs[0]))]


@register
class Rope(RulePass):
    name = "rope"
    description = "RoPE: decompose fused ops, Neg -> Mul(-1), hoist cos/sin into a table or a pos_emb input"

    def __init__(self):
        self.tables: dict[str, np.ndarray] = {}  # "cos"/"sin" -> [max_pos, D] when pos_emb was made
        self.position_input: str | None = None  # the input pos_emb replaced
        self.mode = "table"  # the rope_mode used (rope_tables: picked when the options leave it open)
        self.better: tuple[str, str] | None = None  # (mode, why) when the other mode places better
        rotate_half = RotateHalf()
        self.rules = (FusedRotary(), rotate_half, Hoist(self), FoldedToPosEmb(self, rotate_half))

    def run(self, graph, ctx):
        result = super().run(graph, ctx)
        if self.position_input:
            graph.inputs = [t for t in graph.inputs if t.name != self.position_input or t.outputs]
        if "cos" in self.tables and "sin" in self.tables:  # pos_emb mode: the host indexes [2, max_pos, D]
            result.host["rope"] = np.stack([self.tables["cos"], self.tables["sin"]]).astype(np.float32)
        return result

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """pos_emb[0] = (cos, sin) rows of the original positions (position_ids, or 0..T-1)."""
        if not self.tables:
            return feeds
        feeds = dict(feeds)
        if self.position_input and self.position_input in feeds:
            pos = np.asarray(feeds.pop(self.position_input)).reshape(-1)
        else:
            pos = np.arange(int(ctx.options.seq_len or _seq_from(feeds)))
        feeds[POS_EMB] = np.stack([self.tables["cos"][pos], self.tables["sin"][pos]])[None].astype(np.float32)
        return feeds


def _seq_from(feeds: dict) -> int:
    ids = feeds.get("input_ids")
    return ids.shape[-1] if ids is not None else next(iter(feeds.values())).shape[-1]
