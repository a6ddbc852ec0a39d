"""Fused RoPE ops decomposed into rotate-half (the form rope.RotateHalf matches).

Matched (anchor: each op):

    com.microsoft RotaryEmbedding(x, position_ids, cos_cache, sin_cache)
    RotaryEmbedding (opset 23)(x, cos_cache, sin_cache[, position_ids])
        both: x [B,S,N*D] (num_heads) or [B,N,S,D], caches [max_pos, D/2]

Emitted (cos = Concat(c, c) of the gathered cache row; constants when positions are folded):

    x ─[Reshape to heads]─┬──────────────────────────────────────── Mul(·, cos) ─┐
                          ├─ Slice(D/2:) ─ Mul(-1) ─┐                            ├─ Add ─[Reshape back]
                          └─ Slice(:D/2) ───────────┴─ Concat(-1) ─ Mul(·, sin) ─┘

Refused: interleaved, partial rotary, unknown rank or head size.
"""

from __future__ import annotations

import numpy as np

from mtkc.ir.constants import SMALL, values
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule

MS = "com.microsoft"


def _layout(node) -> tuple[int, int, int]:
    """(rank of x, head size, num_heads) of a fused RoPE node, or Refused."""
    if node.attrs.get("interleaved", 0):
        raise Refused("interleaved RoPE is not rewritten")
    x, cos = node.inputs[0], node.inputs[2 if node.domain == MS else 1]
    heads = int(node.attrs.get("num_heads", 0))
    rank = len(x.shape) if x.shape is not None else None
    if rank not in (3, 4):
        raise Refused(f"input rank {rank} unknown or not 3/4")
    half, width = cos.shape[-1] if cos.shape is not None else None, x.shape[-1]
    if isinstance(half, int):
        head = 2 * half
    elif isinstance(width, int) and (rank == 4 or heads):
        head = width if rank == 4 else width // heads
    else:
        raise Refused("head size unknown (no static cos_cache width or hidden size)")
    if rank == 3 and not heads:
        raise Refused("3-D input needs num_heads")
    rot_dim = int(node.attrs.get("rotary_embedding_dim", 0))
    if rot_dim not in (0, head):
        raise Refused(f"partial rotary ({rot_dim} of {head}) is not rewritten")
    return rank, head, heads


class FusedRotary(Rule):
    anchor, sites = ("RotaryEmbedding", f"{MS}::RotaryEmbedding"), "fused RoPE"

    def check(self, ctx, m):
        _layout(m["node"])

    def rewrite(self, op, ctx, m):
        node = m["node"]
        rank, head, heads = _layout(node)
        x = node.inputs[0]
        if node.domain == MS:
            pos, cos, sin = node.inputs[1], node.inputs[2], node.inputs[3]
        else:
            cos, sin = node.inputs[1], node.inputs[2]
            pos = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
        xin = op.Reshape(x, op.ints("heads", 0, 0, heads, head)) if rank == 3 else x
        halves, axis = [], 2 if rank == 3 else 1
        index = values(pos, max_elements=SMALL) if pos is not None else np.array(0)
        for kind, cache in (("cos", cos), ("sin", sin)):
            table = values(cache, ctx.read_values) if index is not None else None
            if table is not None:  # folded positions: the rows are constants
                rows = table[index] if pos is not None else table
                halves.append(op.const(kind, np.expand_dims(np.concatenate([rows, rows], -1), axis)))
                continue
            rows = op.Gather(cache, pos, axis=0) if pos is not None else cache
            halves.append(op.Unsqueeze(op.Concat(rows, rows, axis=-1), op.ints("axis", axis)))
        lo = op.Slice(xin, op.ints("s", 0), op.ints("e", head // 2), op.ints("a", -1))
        hi = op.Slice(xin, op.ints("s", head // 2), op.ints("e", head), op.ints("a", -1))
        rotated = op.Concat(op.negate(hi), lo, axis=-1)
        y = op.Add(op.Mul(xin, halves[0]), op.Mul(rotated, halves[1]))
        if rank == 3:
            y = op.Reshape(y, op.ints("flat", 0, 0, -1))
        return [(node.outputs[0], y)]
