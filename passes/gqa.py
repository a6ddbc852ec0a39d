"""gqa: com.microsoft GroupQueryAttention (onnxruntime-genai's model builder) as a plain export.

GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
cos_cache, sin_cache, position_ids?, attention_bias?, head_sink?) -> output, present_key,
present_value: packed [B,S,(H+2Hkv)·D] or separate QKV; with `do_rotary` the op rotates Q and K
itself (rotate-half, cos/sin rows at each token's position; over the first R = 2·cos width dims only, the rest passed: partial
rotary); past and present are consumed and
made by the op; `seqlens_k` (valid length - 1) and `total_sequence_length` come from the 2-D mask.
Emitted, before `kv-cache` (which then finds the cache by structure, as in any torch export):

    QKV ─ Split ─ q,k,v ─ Reshape[0,0,n,D] ─ Transpose(0,2,1,3)
    k,q ─ x·cos + rotate_half(x)·sin        cos/sin = Concat(c, c) of Gather(cos_cache, position_ids)
    present_key   = Concat(past_key, k, axis=2)      (the op's present outputs, by name)
    present_value = Concat(past_value, v, axis=2)
    Softmax(Mul(q, scale) @ Transpose(Tile-repeat(K)) + M) @ Tile-repeat(V) ─ Transpose ─ Reshape [0,0,H·D]
    M = Where(And(kv <= q position, attention_mask), 0, finfo.min)  from the 2-D mask (the mask pass
        replaces it by the additive input); repeat-kv is Tile [1,1,n_rep,1] + Reshape, 4-D.

A new input `position_ids` [batch, seq] replaces the positions the op derives from seqlens_k
(left-aligned valid tokens: position = past + i); the cos/sin caches are cut to `max_positions`
rows (C + T) when compiling prefill/decode. Refused (Miss): interleaved rotary, local
window, softcap, smooth softmax, attention bias or head sink, no 2-D mask input, unknown head size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.cache import gqa_head_size, op_input, rope_table_width
from mtkc.analysis.decoder import padding_mask
from mtkc.display import escape
from mtkc.errors import InputError
from mtkc.ir.graph_utils import replace_uses
from mtkc.ir.outdir import read_json
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

MS = "com.microsoft"
POSITIONS = "position_ids"


def _float(t: gs.Tensor) -> np.dtype:
    """The float dtype the op computes in (its query's; float32 when untyped)."""
    return np.dtype(t.dtype) if t.dtype is not None else np.dtype(np.float32)


def _scalar(e: Emit, what: str, value: int) -> gs.Constant:
    """A 0-d int64 constant (Range takes scalars; `Emit.const` makes arrays at least 1-d)."""
    return gs.Constant(e.name(what), np.array(value, np.int64))


def _refusal(node: gs.Node, mask: gs.Tensor | None) -> str | None:
    a = node.attrs
    if a.get("rotary_interleaved", 0):
        return "interleaved rotary is not decomposed"
    unsupported = [what for what, on in (
        (f"local window {a.get('local_window_size')}" + (" on a window-sized cache (sliding_window_cache)"
                                                          if a.get("sliding_window_cache", 0) else ""),
         a.get("local_window_size", -1) not in (-1, None)),
        (f"softcap {a.get('softcap', 0.0):g}", a.get("softcap", 0.0)), ("smooth softmax", a.get("smooth_softmax", 0))) if on]
    if unsupported:
        return f"{' and '.join(unsupported)} {'are' if len(unsupported) > 1 else 'is'} not decomposed"
    if op_input(node, 10) is not None or op_input(node, 11) is not None:
        return "attention_bias / head_sink is not decomposed"
    if op_input(node, 3) is None or op_input(node, 4) is None:
        return "no past_key/past_value inputs"
    if mask is None:
        return "no 2-D integer attention mask input (seqlens_k has no source to rebuild the mask from)"
    return None


class _Shared:
    """Per-graph tensors every layer reads: position_ids, the bool mask M."""

    def __init__(self, graph: gs.Graph, mask: gs.Variable, max_positions: int | None):
        self.graph, self.mask, self.e = graph, mask, Emit(graph, "gqa")
        self.rows, self.tables = max_positions, {}
        self.positions = next((t for t in graph.inputs if t.name == POSITIONS), None)
        self.added = self.positions is None
        if self.added:
            batch = mask.shape[0] if mask.shape else "batch_size"
            self.positions = gs.Variable(POSITIONS, np.int64, [batch, "sequence_length"])
            graph.inputs.append(self.positions)
        self.bias = None

    def table(self, cache: gs.Tensor) -> gs.Tensor:
        """[rows, D] = Concat(c, c) of the first `max_positions` rows (every position a compiled
        graph can see): a constant `fold` makes, small enough for the RoPE table lookup."""
        if id(cache) not in self.tables:
            e, f32 = self.e, _float(cache)
            rows = cache if not self.rows else e.op(
                "Slice", [cache, e.ints("first", 0), e.ints("rows", self.rows), e.ints("axis0", 0)], dtype=f32)
            self.tables[id(cache)] = e.op("Concat", [rows, rows], {"axis": -1}, dtype=f32)
        return self.tables[id(cache)]

    def additive(self, q4: gs.Tensor) -> gs.Tensor:
        """Where(visible, 0, finfo.min) [B,1,S,L]: key j visible to query i iff j <= L-S+i and mask[j]
        (in the scores' dtype: an fp16 export's lowest is fp16's)."""
        if self.bias is None:
            e, i64 = self.e, np.int64
            total = e.op("Gather", [e.op("Shape", [self.mask], dtype=i64), _scalar(e, "one", 1)],
                         {"axis": 0}, dtype=i64, shape=[])
            seq = e.op("Gather", [e.op("Shape", [q4], dtype=i64), _scalar(e, "two", 2)], {"axis": 0},
                       dtype=i64, shape=[])
            zero, one = _scalar(e, "zero", 0), _scalar(e, "step", 1)
            kv = e.op("Range", [zero, total, one], dtype=i64)
            q = e.op("Range", [e.op("Sub", [total, seq], dtype=i64, shape=[]), total, one], dtype=i64)
            causal = e.op("LessOrEqual", [e.op("Unsqueeze", [kv, e.ints("ax0", 0)], dtype=i64),
                                          e.op("Unsqueeze", [q, e.ints("ax1", 1)], dtype=i64)], dtype=np.bool_)
            keep = e.op("Unsqueeze", [e.op("Cast", [self.mask], {"to": 9}, dtype=np.bool_), e.ints("ax12", 1, 2)],
                        dtype=np.bool_)
            visible = e.op("And", [causal, keep], dtype=np.bool_)
            ft = _float(q4)
            self.bias = e.op("Where", [visible, e.const("open", np.array(0.0, ft)),
                                       e.const("lowest", np.array(np.finfo(ft).min, ft))], dtype=ft)
        return self.bias


def _decompose(graph: gs.Graph, node: gs.Node, shared: _Shared) -> str | None:
    heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
    d = gqa_head_size(node, heads, kv_heads)
    if not d or heads % kv_heads:
        return "head size unknown (no static cos cache, key, past or query size)"
    e = Emit(graph, node.name)
    f32 = _float(node.inputs[0])  # fp16 exports compute (and keep their cache) in fp16
    if op_input(node, 1) is None:
        q, k, v = e.op("Split", [node.inputs[0], e.ints("sizes", heads * d, kv_heads * d, kv_heads * d)],
                       {"axis": -1}, dtype=f32, outputs=3)
    else:
        q, k, v = node.inputs[:3]

    def heads_first(t, n):
        return e.op("Transpose", [e.op("Reshape", [t, e.ints("split_heads", 0, 0, n, d)], dtype=f32)],
                    {"perm": [0, 2, 1, 3]}, dtype=f32)

    q4, k4, v4 = heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads)
    if node.attrs.get("do_rotary", 0):
        positions = op_input(node, 9) or shared.positions
        tables = [e.op("Unsqueeze", [e.op("Gather", [shared.table(cache), positions], {"axis": 0}, dtype=f32),
                                     e.ints("ax", 1)], dtype=f32) for cache in (node.inputs[7], node.inputs[8])]
        rot = 2 * (rope_table_width(node.inputs[7]) or d // 2)
        q4, k4 = (_rotate(e, x, d, rot, *tables) for x in (q4, k4))
    presents = []
    for i, (past, new) in enumerate(((node.inputs[3], k4), (node.inputs[4], v4)), start=1):
        out = node.outputs[i] if len(node.outputs) > i else None
        full = e.op("Concat", [past, new], {"axis": 2}, dtype=f32)
        if out is not None and (out.outputs or out in graph.outputs):
            replace_uses(graph, out, full)
        presents.append(full)
    n_rep = heads // kv_heads
    k_all, v_all = presents
    if n_rep > 1:
        k_all, v_all = (e.op("Reshape", [e.op("Tile", [t, e.ints("repeats", 1, 1, n_rep, 1)], dtype=f32),
                                         e.ints("heads", 0, heads, -1, d)], dtype=f32) for t in presents)
    scale = float(node.attrs.get("scale", 0.0) or 1.0 / np.sqrt(d))
    scores = e.op("MatMul", [e.op("Mul", [q4, e.const("scale", np.array(scale, f32))], dtype=f32),
                             e.op("Transpose", [k_all], {"perm": [0, 1, 3, 2]}, dtype=f32)], dtype=f32)
    probs = e.op("Softmax", [e.op("Add", [scores, shared.additive(q4)], dtype=f32)], {"axis": -1}, dtype=f32)
    out = e.op("Reshape", [e.op("Transpose", [e.op("MatMul", [probs, v_all], dtype=f32)], {"perm": [0, 2, 1, 3]},
                                dtype=f32), e.ints("merge_heads", 0, 0, heads * d)], dtype=f32)
    replace_uses(graph, node.outputs[0], out)
    node.outputs.clear()
    return None


def _rotate(e: Emit, x: gs.Tensor, d: int, rot: int, cos: gs.Tensor, sin: gs.Tensor) -> gs.Tensor:
    """x·cos + rotate_half(x)·sin over the first `rot` dims (the rest pass: partial rotary),
    rotate_half(x) = Concat(-x[..., R/2:R], x[..., :R/2])."""
    f32 = _float(x)
    axis = e.ints("axis3", 3)
    part = x if rot == d else e.op("Slice", [x, e.ints("start0", 0), e.ints("rot", rot), axis], dtype=f32)
    first = e.op("Slice", [part, e.ints("start0", 0), e.ints("half", rot // 2), axis], dtype=f32)
    second = e.op("Slice", [part, e.ints("half", rot // 2), e.ints("end", rot), axis], dtype=f32)
    rotated = e.op("Concat", [e.op("Neg", [second], dtype=f32), first], {"axis": -1}, dtype=f32)
    out = e.op("Add", [e.op("Mul", [part, cos], dtype=f32), e.op("Mul", [rotated, sin], dtype=f32)], dtype=f32)
    if rot == d:
        return out
    rest = e.op("Slice", [x, e.ints("rot", rot), e.ints("end_d", d), axis], dtype=f32)
    return e.op("Concat", [out, rest], {"axis": -1}, dtype=f32)


def _declared_window(root) -> int | None:
    """The sliding window onnxruntime-genai's `genai_config.json` beside the model declares, if any."""
    path = Path(root) / "genai_config.json" if root is not None else None
    if path is None or not path.is_file():
        return None
    config = read_json(path, 1 << 20, "unreadable genai_config.json")
    window = ((config.get("model") or {}).get("decoder") or {}).get("sliding_window") if isinstance(config, dict) else None
    size = window.get("window_size") if isinstance(window, dict) else None
    return size if isinstance(size, int) and size > 0 else None


@register
class GroupQueryAttentionPass(Pass):
    name = "gqa"
    description = "com.microsoft GroupQueryAttention (packed/separate QKV, in-op rotary, past/present) -> plain ops"
    before = ("mask-early", "kv-cache")  # its cache becomes a Concat(past, new, axis=2) first

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        self.added = False
        sites = [n for n in graph.nodes if n.op == "GroupQueryAttention" and n.domain == MS]
        if not sites:
            return result
        mask = padding_mask(graph)
        shared = None
        for layer, node in enumerate(sites):
            why = _refusal(node, mask)
            if why is None:
                shared = shared or _Shared(graph, mask, ctx.options.max_positions)
                why = _decompose(graph, node, shared)
            if why is None:
                result.rewrites += 1
            elif ctx.options.kv_cache and op_input(node, 3) is not None:  # its cache would be lost
                raise InputError(f"layer {layer}: GroupQueryAttention '{escape(node.name)}' (its cache inside the op): "
                                 f"{why}, so mtkc cannot give it a static cache")
            else:
                result.misses.append(Miss(node.name, why))
        self.added = bool(shared and shared.added)
        declared = _declared_window(ctx.root)
        if declared and all(n.attrs.get("local_window_size", -1) in (-1, None) for n in sites):
            result.notes.append(f"genai_config.json declares a sliding window of {declared}, but no GroupQueryAttention "
                                "applies one (local_window_size -1): the export, and so these graphs, attend over the "
                                "whole history, unlike the model (onnxruntime-genai's builder dropped its window)")
        return result

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """The positions the op derived from the mask: valid tokens counted from 0, the last S kept."""
        if not self.added:
            return feeds
        mask = next(np.asarray(v) for k, v in feeds.items() if np.ndim(v) == 2 and "mask" in k)
        seq = next(np.asarray(v).shape[1] for k, v in feeds.items() if k in ("input_ids", "hidden_states"))
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -seq:]
        return {**feeds, POSITIONS: positions.astype(np.int64)}
