"""Fused attention ops decomposed into the canonical 4-D MatMul / Mul / Add / Softmax / MatMul.

Matched (anchor: each op):

    com.microsoft MultiHeadAttention (3-D or BNSH K/V, optional attention_bias, no past/padding mask)
    com.microsoft GroupQueryAttention (separate K/V, past/present, causal; seqlens_k is taken as
        past + seq - 1, i.e. no padding: the mask pass supplies padding as an additive mask)
    Attention (opset 23) (3-D or 4-D, float or bool mask, is_causal, past/present, GQA)

Emitted (3-D inputs are split into heads first and merged back after):

    Q ─ Mul(scale) ──────────────────────────┐
    [past ─ Concat(K)] ─ [Tile ─ Reshape] ─ Transpose ─┴─ MatMul ─ [Add(mask)] ─ [Add(causal)] ─ Softmax ─┐
    [past ─ Concat(V)] ─ [Tile ─ Reshape] ─────────────────────────────────────────────────── MatMul ──┴─

GQA heads are repeated 4-D, as MediaTek's export does: Tile(K, [1,1,n_rep,1]) -> Reshape [B, H, L, D].
Refused: softcap, qk_matmul_output, unknown head size or lengths (static shapes needed for the
causal mask); GroupQueryAttention with packed QKV, rotary, local window or smooth softmax.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.contract import mask as contract_mask
from mtkc.ir.graph_utils import is_used
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule

MS = "com.microsoft"
def _input(node: gs.Node, i: int) -> gs.Tensor | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


class FusedAttention(Rule):
    anchor, sites = (f"{MS}::MultiHeadAttention", f"{MS}::GroupQueryAttention", "Attention"), "fused attention"

    def check(self, ctx, m):
        node, attrs = m["node"], m["node"].attrs
        used = [i for i, o in enumerate(node.outputs) if is_used(m.graph, o)]
        if node.op == "GroupQueryAttention":
            if _input(node, 1) is None or any(_input(node, i) for i in (7, 8, 11)) or attrs.get("do_rotary", 0):
                raise Refused("GroupQueryAttention with packed QKV, rotary or head_sink is not decomposed")
            if attrs.get("softcap", 0.0) or attrs.get("smooth_softmax", 0) or \
                    attrs.get("local_window_size", -1) not in (-1, None):
                raise Refused("GroupQueryAttention with softcap, smooth_softmax or a local window is not decomposed")
        elif node.op == "MultiHeadAttention":
            if any(_input(node, i) for i in (3, 4, 6, 7)) or used != [0]:
                raise Refused("MultiHeadAttention with bias, key_padding_mask, past or present is not decomposed")
            if attrs.get("unidirectional", 0):
                raise Refused("unidirectional MultiHeadAttention is not decomposed")
        elif attrs.get("softcap", 0.0) or 3 in used:
            raise Refused("Attention with softcap or qk_matmul_output is not decomposed")

    def rewrite(self, op, ctx, m):
        node, attrs = m["node"], m["node"].attrs
        masked = contract_mask.value_of(ctx.options)
        scale = attrs.get("scale")
        if node.op == "GroupQueryAttention":
            outs = _emit(op, node, attrs.get("num_heads"), attrs.get("kv_num_heads"), scale, _input(node, 10),
                         _input(node, 3), _input(node, 4), True, masked)
        elif node.op == "MultiHeadAttention":
            heads = int(attrs["num_heads"])
            outs = _emit(op, node, heads, heads, scale, _input(node, 5), None, None, False, masked)
        else:
            outs = _emit(op, node, attrs.get("q_num_heads"), attrs.get("kv_num_heads"), scale, _input(node, 3),
                         _input(node, 4), _input(node, 5), bool(attrs.get("is_causal", 0)), masked)
        return [(old, new) for old, new in zip(node.outputs, outs) if old is node.outputs[0] or is_used(m.graph, old)]


def _emit(op: Emit, node, q_heads, kv_heads, scale, mask, past_k, past_v, causal, masked) -> list[gs.Tensor]:
    """[output, present K, present V] of the decomposed attention."""
    q, k, v = node.inputs[:3]
    if q.shape is None or len(q.shape) not in (3, 4):
        raise Refused("query rank unknown")
    three_d = len(q.shape) == 3
    if three_d and not (q_heads and kv_heads):
        raise Refused("3-D inputs need the head counts")
    if three_d:  # hidden size from whichever of q, k, v has it static
        sizes = [t.shape[-1] // int(n) for t, n in ((q, q_heads), (k, kv_heads), (v, kv_heads))
                 if t.shape is not None and isinstance(t.shape[-1], int)]
        head = sizes[0] if sizes else None
    else:
        head = q.shape[-1] if isinstance(q.shape[-1], int) else None
        q_heads = q_heads or q.shape[1]
        kv_heads = kv_heads or (k.shape[1] if k.shape is not None else None)
    if not head or not isinstance(q_heads, int) or not isinstance(kv_heads, int) or q_heads % kv_heads:
        raise Refused("head size or head counts unknown")
    dtype = np.dtype(q.dtype) if q.dtype is not None else np.dtype(np.float32)
    bias = _causal_bias(q, k, past_k, dtype, masked) if causal else None
    if causal and bias is None:
        raise Refused("is_causal needs static query and key lengths")

    def heads_first(t, n):  # [B, S, n*D] -> [B, n, S, D]
        if t.shape is not None and len(t.shape) == 4:
            return t
        return op.Transpose(op.Reshape(t, op.ints("split_heads", 0, 0, n, head)), perm=[0, 2, 1, 3])

    present = [op.Concat(past, cur, axis=2) if past is not None else cur
               for past, cur in ((past_k, heads_first(k, kv_heads)), (past_v, heads_first(v, kv_heads)))]
    k4, v4 = present
    n_rep = q_heads // kv_heads
    if n_rep > 1:
        k4, v4 = (op.Reshape(op.Tile(t, op.ints("repeats", 1, 1, n_rep, 1)), op.ints("heads", 0, q_heads, -1, head))
                  for t in (k4, v4))
    s = float(scale) if scale else 1.0 / np.sqrt(head)
    qs = op.Mul(heads_first(q, q_heads), op.const("scale", np.array(s, dtype)))
    scores = op.MatMul(qs, op.Transpose(k4, perm=[0, 1, 3, 2]))
    if mask is not None:
        if mask.dtype == np.bool_:
            mask = op.Where(mask, op.const("zero", np.array(0.0, dtype)), op.const("neg", np.array(masked, dtype)),
                            _dtype=q.dtype)
        scores = op.Add(scores, mask)
    if bias is not None:
        scores = op.Add(scores, op.const("causal", bias))
    out = op.MatMul(op.Softmax(scores, axis=-1), v4)
    if three_d:
        out = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), op.ints("merge_heads", 0, 0, -1))
    return [out, *present]


def _causal_bias(q, k, past_k, dtype, masked):
    """[S, L] additive: key j is visible to query i iff j <= i + past (bottom-right aligned)."""
    def length(t):
        return None if t is None or t.shape is None else (t.shape[-2] if len(t.shape) == 4 else t.shape[1])

    seq, cur = length(q), length(k)
    past = 0 if past_k is None else length(past_k)
    if not all(isinstance(d, int) for d in (seq, cur, past)):
        return None
    return contract_mask.additive(seq, cur + past, masked, dtype=dtype, offset=past)
