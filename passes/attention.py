"""Attention: scaled dot-product attention as MatMul / Mul / Add / Softmax / MatMul, 4-D only.

No SDK table has a fused attention op, so every form ends as

    Q ─ Mul(1/√d) ─┐
    Kᵀ ────────────┴─ MatMul ─ Add(mask) ─ Softmax(-1) ─┐
    V ──────────────────────────────────────────────────┴─ MatMul

Matched (anchor: each Softmax; each fused op is a site):

    SDPA export   MatMul(Mul(Q, √s), Mul(Kᵀ, √s))   -> one Mul(Q, s); the 3-D Kᵀ trick
                  Reshape(Transpose(Reshape(K, [-1,T,D]), [0,2,1]), [B,H,D,T]) -> Transpose(K, [0,1,3,2])
    row guards    Where(IsNaN(P), 0, P) -> P;  Where(Less(ReduceSum(mask), 1), 0, O) -> O
                  (they only zero fully-masked rows; a finite additive mask has none)
    eager export  Mul(MatMul(Q, Kᵀ), s) | Div(MatMul(Q, Kᵀ), √d): already canonical
    com.microsoft MultiHeadAttention (3-D or BNSH K/V, optional attention_bias, no past/padding mask)
    com.microsoft GroupQueryAttention (separate K/V, past/present, causal; seqlens_k is taken as
        past + seq - 1, i.e. no padding: the mask pass supplies padding as an additive mask)
    Attention (opset 23) (3-D or 4-D, float or bool mask, is_causal, past/present, GQA)

GQA heads are repeated 4-D, as MediaTek's export does: Tile(K, [1,1,n_rep,1]) -> Reshape [B, H, L, D].
Refused: softcap, qk_matmul_output, unknown head size or lengths (static shapes needed for the
causal mask); GroupQueryAttention with packed QKV, rotary, local window or smooth softmax.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.contract import mask as contract_mask
from mtkc.ir.graph_utils import replace_uses
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register
from mtkc.rewrite.pattern import Const, Emit, Op, Or, Var, near, small_values

MS = "com.microsoft"


def _last(axis) -> bool:
    """-1 (the last axis)"""
    return axis in (-1, 3, None)


def _scalar(v) -> str | None:
    return None if v.size == 1 else f"scale has {v.size} values"


Q, KT = Var("q"), Var("kt")
SCORES = Or(Op("MatMul", Op("Mul", Q, Const("sq", check=_scalar), name="mul_q"),
               Op("Mul", KT, Const("sk", check=_scalar), name="mul_k"), name="qk"),
            Op("Mul", Op("MatMul", Q, KT, name="qk"), Const("s", check=_scalar)),
            Op("Div", Op("MatMul", Q, KT, name="qk"), Const("s", check=_scalar)),
            Op("MatMul", Q, KT, name="qk"))
PATTERN = Op("Softmax", Or(Op("Add", SCORES, Var("mask"), name="add_mask", commute=False), SCORES),
             attrs={"axis": _last}, name="softmax")


def find(graph: gs.Graph, ctx: Context | None = None):
    """Attention sites (one per Softmax) and the Softmaxes that are not one."""
    sites, misses = [], []
    for node in graph.nodes:
        if node.op == "Softmax":
            m = near(PATTERN, node, "Softmax", steps=0)
            (sites.append(m) if m else misses.append(Miss(node.name, f"{m.reason} (at {m.node})")))
    return sites, misses


@register
class Attention(Pass):
    name = "attention"
    description = "Attention to MatMul/Mul/Add/Softmax/MatMul: one scale Mul, no NaN guards, fused ops decomposed"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        masked = contract_mask.value_of(ctx.options)
        for node in [n for n in graph.nodes if _fused_kind(n)]:
            why = _decompose(graph, node, masked)
            if why:
                result.misses.append(Miss(node.name, why))
            else:
                result.rewrites += 1
        if result.rewrites:
            graph.cleanup().toposort()
        sites, misses = find(graph, ctx)
        result.misses += misses
        for m in sites:
            result.rewrites += _one_scale(graph, m) + _plain_transpose(graph, m)
        result.rewrites += drop(graph, row_guards(graph))
        result.notes.append(f"{len(sites)} attention sites")
        if result.rewrites:
            graph.cleanup().toposort()
        return result


def _one_scale(graph: gs.Graph, m) -> int:
    """MatMul(Mul(Q, a), Mul(Kᵀ, b)) -> MatMul(Mul(Q, a*b), Kᵀ)."""
    if "sq" not in m.bindings:
        return 0
    scale = float(m.value("sq").reshape(-1)[0]) * float(m.value("sk").reshape(-1)[0])
    qk = m["qk"]
    e = Emit(graph, qk.name)
    q = m["q"]
    dtype = np.dtype(q.dtype) if q.dtype is not None else np.dtype(np.float32)
    scaled = e.op("Mul", [q, e.const("scale", np.array(scale, dtype))], dtype=q.dtype, shape=q.shape)
    out = qk.outputs[0]
    new = e.op("MatMul", [scaled, m["kt"]], dtype=out.dtype, shape=out.shape)
    replace_uses(graph, out, new)
    return 1


def _plain_transpose(graph: gs.Graph, m) -> int:
    """Reshape(Transpose(Reshape(K, [-1,T,D]), [0,2,1]), [B,H,D,T]) -> Transpose(K, [0,1,3,2]) (static shapes;
    K is first reshaped to [B,H,T,D] when it arrives in another rank)."""
    kt = m["kt"]
    outer = kt.inputs[0] if len(kt.inputs) == 1 else None
    if outer is None or outer.op != "Reshape":
        return 0
    mid = outer.inputs[0].inputs[0] if outer.inputs[0].inputs else None
    if mid is None or mid.op != "Transpose" or list(mid.attrs.get("perm", [])) != [0, 2, 1]:
        return 0
    inner = mid.inputs[0].inputs[0] if mid.inputs[0].inputs else None
    if inner is None or inner.op != "Reshape":
        return 0
    k, flat = inner.inputs[0], inner.outputs[0]
    if not (_static(k) and _static(kt) and _static(flat) and len(kt.shape) == 4 and len(flat.shape) == 3):
        return 0
    b, h, d, t = kt.shape
    if list(flat.shape) != [b * h, t, d] or list(k.shape[-2:]) != [t, d]:
        return 0
    e = Emit(graph, outer.name)
    if list(k.shape) != [b, h, t, d]:  # e.g. the 5-D GQA repeat folded into this Reshape
        k = e.op("Reshape", [k, e.ints("shape", b, h, t, d)], dtype=kt.dtype, shape=[b, h, t, d])
    new = e.op("Transpose", [k], {"perm": [0, 1, 3, 2]}, dtype=kt.dtype, shape=kt.shape)
    replace_uses(graph, kt, new)
    return 1


def _static(t: gs.Tensor) -> bool:
    return t.shape is not None and all(isinstance(d, int) and d >= 0 for d in t.shape)


def row_guards(graph: gs.Graph) -> list[tuple[gs.Node, gs.Tensor]]:
    """(Where, data) for Where(IsNaN(P), 0, P) and Where(Less(ReduceSum(·), 1), 0, O)."""
    guards = []
    for node in graph.nodes:
        if node.op != "Where" or len(node.inputs) != 3 or not node.outputs or node.outputs[0] in graph.outputs:
            continue
        cond, zero, data = node.inputs
        zv = small_values(zero)
        if zv is None or zv.size != 1 or float(zv.reshape(-1)[0]) != 0.0 or not cond.inputs:
            continue
        test = cond.inputs[0]
        nan_guard = test.op == "IsNaN" and test.inputs[0] is data
        empty_row = test.op == "Less" and test.inputs[0].inputs and test.inputs[0].inputs[0].op == "ReduceSum" \
            and (v := small_values(test.inputs[1])) is not None and v.size == 1 and float(v.reshape(-1)[0]) == 1.0
        if nan_guard or empty_row:
            guards.append((node, data))
    return guards


def drop(graph: gs.Graph, guards: list[tuple[gs.Node, gs.Tensor]]) -> int:
    """Bypass each guard Where (its output becomes its data input)."""
    for node, data in guards:
        replace_uses(graph, node.outputs[0], data)
        node.outputs.clear()
    return len(guards)


# -- fused attention ops -------------------------------------------------------------------------
def _fused_kind(node: gs.Node) -> str | None:
    domain = node.domain or ""
    if domain == MS and node.op in ("MultiHeadAttention", "GroupQueryAttention"):
        return node.op
    if domain in ("", "ai.onnx") and node.op == "Attention":
        return "Attention"
    return None


def _input(node: gs.Node, i: int) -> gs.Tensor | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def _decompose(graph: gs.Graph, node: gs.Node, masked: float) -> str | None:
    kind = _fused_kind(node)
    used = [i for i, o in enumerate(node.outputs) if o.outputs or o in graph.outputs]
    if kind == "GroupQueryAttention":
        if _input(node, 1) is None or any(_input(node, i) for i in (7, 8, 11)) or node.attrs.get("do_rotary", 0):
            return "GroupQueryAttention with packed QKV, rotary or head_sink is not decomposed"
        if node.attrs.get("softcap", 0.0) or node.attrs.get("smooth_softmax", 0) or \
                node.attrs.get("local_window_size", -1) not in (-1, None):
            return "GroupQueryAttention with softcap, smooth_softmax or a local window is not decomposed"
        return _emit(graph, node, node.attrs.get("num_heads"), node.attrs.get("kv_num_heads"), node.attrs.get("scale"),
                     _input(node, 10), _input(node, 3), _input(node, 4), True, masked)
    if kind == "MultiHeadAttention":
        if any(_input(node, i) for i in (3, 4, 6, 7)) or used != [0]:
            return "MultiHeadAttention with bias, key_padding_mask, past or present is not decomposed"
        if node.attrs.get("unidirectional", 0):
            return "unidirectional MultiHeadAttention is not decomposed"
        heads = int(node.attrs["num_heads"])
        return _emit(graph, node, heads, heads, node.attrs.get("scale"), _input(node, 5), None, None, False, masked)
    if node.attrs.get("softcap", 0.0) or 3 in used:
        return "Attention with softcap or qk_matmul_output is not decomposed"
    return _emit(graph, node, node.attrs.get("q_num_heads"), node.attrs.get("kv_num_heads"), node.attrs.get("scale"),
                 _input(node, 3), _input(node, 4), _input(node, 5), bool(node.attrs.get("is_causal", 0)), masked)


def _emit(graph, node, q_heads, kv_heads, scale, mask, past_k, past_v, causal, masked) -> str | None:
    q, k, v = node.inputs[:3]
    if q.shape is None or len(q.shape) not in (3, 4):
        return "query rank unknown"
    three_d = len(q.shape) == 3
    if three_d and not (q_heads and kv_heads):
        return "3-D inputs need the head counts"
    if three_d:  # hidden size from whichever of q, k, v has it static
        sizes = [t.shape[-1] // int(n) for t, n in ((q, q_heads), (k, kv_heads), (v, kv_heads))
                 if t.shape is not None and isinstance(t.shape[-1], int)]
        head = sizes[0] if sizes else None
    else:
        head = q.shape[-1] if isinstance(q.shape[-1], int) else None
        q_heads = q_heads or q.shape[1]
        kv_heads = kv_heads or (k.shape[1] if k.shape is not None else None)
    if not head or not isinstance(q_heads, int) or not isinstance(kv_heads, int) or q_heads % kv_heads:
        return "head size or head counts unknown"
    e = Emit(graph, node.name)
    f32 = q.dtype

    def heads_first(t, n):  # [B, S, n*D] -> [B, n, S, D]
        if t.shape is not None and len(t.shape) == 4:
            return t
        return e.op("Transpose", [e.op("Reshape", [t, e.ints("split_heads", 0, 0, n, head)], dtype=f32)],
                    {"perm": [0, 2, 1, 3]}, dtype=f32)

    q4, k4, v4 = heads_first(q, q_heads), heads_first(k, kv_heads), heads_first(v, kv_heads)
    present = []
    for past, cur in ((past_k, k4), (past_v, v4)):
        present.append(e.op("Concat", [past, cur], {"axis": 2}, dtype=f32) if past is not None else cur)
    k4, v4 = present
    n_rep = q_heads // kv_heads
    if n_rep > 1:
        k4, v4 = (e.op("Reshape", [e.op("Tile", [t, e.ints("repeats", 1, 1, n_rep, 1)], dtype=f32),
                                   e.ints("heads", 0, q_heads, -1, head)], dtype=f32) for t in (k4, v4))
    s = float(scale) if scale else 1.0 / np.sqrt(head)
    dtype = np.dtype(f32) if f32 is not None else np.dtype(np.float32)
    qs = e.op("Mul", [q4, e.const("scale", np.array(s, dtype))], dtype=f32)
    kt = e.op("Transpose", [k4], {"perm": [0, 1, 3, 2]}, dtype=f32)
    scores = e.op("MatMul", [qs, kt], dtype=f32)
    if mask is not None:
        if mask.dtype == np.bool_:
            mask = e.op("Where", [mask, e.const("zero", np.array(0.0, dtype)), e.const("neg", np.array(masked, dtype))],
                        dtype=f32)
        scores = e.op("Add", [scores, mask], dtype=f32)
    if causal:
        bias = _causal_bias(q, k, past_k, dtype, masked)
        if bias is None:
            return "is_causal needs static query and key lengths"
        scores = e.op("Add", [scores, e.const("causal", bias)], dtype=f32)
    probs = e.op("Softmax", [scores], {"axis": -1}, dtype=f32)
    out = e.op("MatMul", [probs, v4], dtype=f32)
    if three_d:
        out = e.op("Reshape", [e.op("Transpose", [out], {"perm": [0, 2, 1, 3]}, dtype=f32), e.ints("merge_heads", 0, 0, -1)],
                   dtype=f32)
    outs = node.outputs
    out.shape = outs[0].shape
    replace_uses(graph, outs[0], out)
    for i, new in ((1, present[0]), (2, present[1])):
        if len(outs) > i and (outs[i].outputs or outs[i] in graph.outputs):
            replace_uses(graph, outs[i], new)
    node.outputs.clear()
    return None


def _causal_bias(q, k, past_k, dtype, masked):
    """[S, L] additive: key j is visible to query i iff j <= i + past (bottom-right aligned)."""
    def length(t):
        return None if t is None or t.shape is None else (t.shape[-2] if len(t.shape) == 4 else t.shape[1])

    seq, cur = length(q), length(k)
    past = 0 if past_k is None else length(past_k)
    if not all(isinstance(d, int) for d in (seq, cur, past)):
        return None
    return contract_mask.additive(seq, cur + past, masked, dtype=dtype, offset=past)

