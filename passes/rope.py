"""RoPE: rotate-half with Mul(-1) instead of Neg, fused RoPE ops decomposed, cos/sin hoisted.

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2])

Matched (anchor: each Neg or Mul(·, -1); every fused op is a site):

    x ─┬────────────────────────────────────────── Mul(·, cos) ─┐
       ├─ Slice(D/2:) ─ Neg ─┐                                  ├─ Add
       └─ Slice(:D/2) ───────┴─ Concat(-1) ─────── Mul(·, sin) ─┘

    com.microsoft RotaryEmbedding(x, position_ids, cos_cache, sin_cache)
    RotaryEmbedding (opset 23)(x, cos_cache, sin_cache[, position_ids])
        both: x [B,S,N*D] (num_heads) or [B,N,S,D], caches [max_pos, D/2]; emitted as the sketch
        above with cos = Concat(c, c) of the gathered cache row. Refused: interleaved, partial rotary.

cos/sin hoisting (anchor: each Cos / Sin; they are unsupported on every MDLA): the subgraph from
the position source (position_ids input, or a Range) to the cos/sin tensor — inv_freq, rope_theta,
attention scaling as the export has them — is *evaluated* in onnxruntime for positions
0..max_pos-1 and replaced by, per option `rope_mode`:

    table   (default) Gather(cos_table[max_pos, F], positions)       max_pos = option max_positions
                                                                      or cache_len + seq_len
    pos_emb a graph input pos_emb [1, 2, T, D] (cos, sin: MediaTek's convention), sliced
            Squeeze(Slice(pos_emb, 0:1 | 1:2, axis 1)); position_ids is then dropped. cos/sin
            that shape folding already made constants (no cache: positions 0..T-1) become
            pos_emb slices too, so every graph variant takes the same inputs.
`map_feeds` builds pos_emb from the original position_ids (or 0..T-1) with the evaluated tables.

Refused: cos/sin depending on more than one position source (bind shapes first), no table size
(give seq_len/cache_len or max_positions), or a result that is not [.., positions, F].
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.contract import io
from mtkc.ir.graph_utils import replace_uses
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register
from mtkc.rewrite.pattern import Const, Emit, Op, Or, Var, constant_of, near, small_values, values_of

MS = "com.microsoft"
POS_EMB = io.POS_EMB
TABLE = "rope_table"  # in the names of the hoisted cos/sin tables (the embedding pass leaves them alone)


def _last_axis(axis) -> bool:
    """-1 (the last axis)"""
    return axis in (-1, 3)


def _pattern() -> Op:
    x = Var("x")
    lo = Op("Slice", x, name="lo", extra_inputs=True)
    hi = Op("Slice", x, name="hi", extra_inputs=True)
    flip = Or(Op("Neg", hi, name="neg"), Op("Mul", hi, Const(value=-1.0), name="neg"))
    rot = Op("Concat", flip, lo, attrs={"axis": _last_axis}, name="rot")
    return Op("Add", Op("Mul", x, Var("cos")), Op("Mul", rot, Var("sin")), name="add")


PATTERN = _pattern()


def find(graph: gs.Graph, ctx: Context | None = None):
    """Rotate-half sites (one per Neg / float Mul(·, -1)) and the anchors that are not one."""
    sites, misses = [], []
    for node in graph.nodes:
        if node.op == "Neg" or (node.op == "Mul" and _minus_one_operand(node)):
            m = near(PATTERN, node, "Add", steps=3, read=ctx.read_values if ctx else None)
            if m and (why := _halves(m)) is None:
                sites.append(m)
            else:
                misses.append(Miss(node.name, why if m else f"{m.reason} (at {m.node})"))
    return sites, misses


def _minus_one_operand(node: gs.Node) -> bool:
    """Mul(x, -1.0) in floating point (an integer -1 is shape arithmetic)."""
    v = small_values(node.inputs[1]) if len(node.inputs) == 2 else None
    return v is not None and v.size == 1 and v.dtype.kind == "f" and float(v.reshape(-1)[0]) == -1.0


def _halves(m) -> str | None:
    """The two slices split the last axis at one point (checked when their bounds are constants)."""
    lo, hi = m["lo"], m["hi"]
    bounds = [small_values(t) for t in (lo.inputs[1], lo.inputs[2], hi.inputs[1])]
    if any(b is None for b in bounds):
        return None  # runtime bounds (TorchScript before folding): structure alone decides
    lo_start, lo_end, hi_start = (int(b.reshape(-1)[0]) for b in bounds)
    if lo_start != 0 or lo_end != hi_start:
        return f"slices [{lo_start}:{lo_end}] and [{hi_start}:] are not the two halves"
    return None


@register
class Rope(Pass):
    name = "rope"
    description = "RoPE: decompose fused ops, Neg -> Mul(-1), hoist cos/sin into a table or a pos_emb input"

    def __init__(self):
        self.tables: dict[str, np.ndarray] = {}  # "cos"/"sin" -> [max_pos, D] when pos_emb was made
        self.position_input: str | None = None

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        for node in [n for n in graph.nodes if n.op == "RotaryEmbedding" and (n.domain or "") in ("", "ai.onnx", MS)]:
            why = _decompose(graph, node)
            if why:
                result.misses.append(Miss(node.name, why))
            else:
                result.rewrites += 1
        sites, misses = find(graph, ctx)
        result.misses += misses
        for m in sites:
            neg = m["neg"]
            if neg.op != "Neg":
                continue
            e = Emit(graph, neg.name)
            flipped = e.op("Mul", [neg.inputs[0], _minus_one(e, neg.outputs[0])], dtype=neg.outputs[0].dtype,
                           shape=neg.outputs[0].shape)
            replace_uses(graph, neg.outputs[0], flipped)
            neg.outputs.clear()
            result.rewrites += 1
        result.notes.append(f"{len(sites)} rotate-half sites")
        result.rewrites += self._hoist(graph, ctx, result)
        if (ctx.options.rope_mode or "table") == "pos_emb":
            result.rewrites += self._folded_to_pos_emb(graph, ctx, sites, result)
        if result.rewrites:
            graph.cleanup().toposort()
        if self.position_input:  # pos_emb replaced it
            graph.inputs = [t for t in graph.inputs if t.name != self.position_input or t.outputs]
        return result

    # -- cos/sin hoisting -------------------------------------------------------------------
    def _hoist(self, graph: gs.Graph, ctx: Context, result: PassResult) -> int:
        trig = [n for n in graph.nodes if n.op in ("Cos", "Sin") and not n.domain]
        groups: dict[int, tuple[gs.Tensor, list]] = {}
        for node in trig:
            source = _position_source(node)
            if isinstance(source, str):
                result.misses.append(Miss(node.name, source))
                continue
            groups.setdefault(id(source), (source, []))[1].append((node, _hoisted(node)))
        mode = ctx.options.rope_mode or "table"
        if mode not in ("table", "pos_emb"):
            result.misses += [Miss(n.name, f"unknown rope_mode '{mode}' (table | pos_emb)") for n in trig]
            return 0
        count = 0
        for source, items in groups.values():
            max_pos = _max_positions(ctx, source)
            if isinstance(max_pos, str):
                result.misses += [Miss(n.name, max_pos) for n, _ in items]
                continue
            tables = _evaluate(graph, ctx, source, [t for _, t in items], max_pos)
            if isinstance(tables, str):
                result.misses += [Miss(n.name, tables) for n, _ in items]
                continue
            for (node, target), (table, rank) in zip(items, tables):
                kind = "cos" if node.op == "Cos" else "sin"
                if mode == "table":
                    new = _gather(graph, node.name, kind, table, source, rank, target)
                else:
                    new = self._from_pos_emb(graph, ctx, node, kind, table, source, target, rank)
                    if isinstance(new, str):
                        result.misses.append(Miss(node.name, new))
                        continue
                replace_uses(graph, target, new)
                count += 1
        return count

    def _from_pos_emb(self, graph, ctx, node, kind, table, source, target, rank):
        if rank != 3:
            return f"{kind} is rank {rank}, pos_emb replaces [1, T, D] tensors only"
        full = table if _full_width(table) else np.concatenate([table, table], axis=-1)
        if source in graph.inputs:
            self.position_input = source.name
        seq = ctx.options.seq_len or (source.shape[-1] if source.shape else "sequence_length")
        return self._slice(graph, node.name, kind, full, table.shape[1], seq, target.shape)

    def _slice(self, graph, prefix, kind, full, width, seq, shape):
        """Slice(pos_emb, cos|sin, first `width` columns) [1,1,T,width], reshaped to `shape` when it differs."""
        pos_emb = next((t for t in graph.inputs if t.name == POS_EMB), None)
        if pos_emb is None:
            pos_emb = gs.Variable(POS_EMB, dtype=np.float32, shape=[1, 2, seq, full.shape[1]])
            graph.inputs.append(pos_emb)
        elif pos_emb.shape[-1] != full.shape[1]:
            return f"pos_emb has width {pos_emb.shape[-1]}, {kind} needs {full.shape[1]}"
        self.tables[kind] = full
        e = Emit(graph, prefix)
        k = 0 if kind == "cos" else 1
        sliced = e.op("Slice", [pos_emb, e.ints("starts", k, 0), e.ints("ends", k + 1, width), e.ints("axes", 1, 3)],
                      dtype=np.float32)
        shape = list(shape) if shape is not None else None
        if shape == [1, 1, seq, width]:
            sliced.shape = shape
            return sliced
        if shape is not None and all(isinstance(d, int) for d in shape):  # [1, T, D] or [1, T, 1, D] (BSND)
            return e.op("Reshape", [sliced, e.ints("shape", *shape)], shape=shape)
        return e.op("Squeeze", [sliced, e.ints("axes", 1)], shape=shape)

    def _folded_to_pos_emb(self, graph, ctx, sites, result) -> int:
        """cos/sin already folded to constants (positions 0..T-1, no cache) -> pos_emb slices."""
        done = {}
        for m in sites:
            for kind in ("cos", "sin"):
                const = _constant_source(m[kind])
                if const is None or id(const) in done:
                    continue
                values = np.asarray(values_of(const, ctx.read_values))
                width = values.shape[-1] if values.ndim in (3, 4) else 0
                seq = values.size // width if width else 0
                if not width or sorted(d for d in values.shape if d != 1) not in (sorted([seq, width]), [width]):
                    result.misses.append(Miss(m["add"].name, f"constant {kind} has shape {list(values.shape)}"))
                    continue
                new = self._slice(graph, m["add"].name, kind, values.reshape(seq, width), width, seq, values.shape)
                if isinstance(new, str):
                    result.misses.append(Miss(m["add"].name, new))
                    continue
                done[id(const)] = new
                replace_uses(graph, const, new)
        return len(done)

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


def _constant_source(tensor: gs.Tensor) -> gs.Constant | None:
    """The constant a cos/sin operand is computed from through shape-only ops, if any."""
    for _ in range(4):
        if isinstance(tensor, gs.Constant):
            return tensor
        node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if node is None or node.op not in ("Unsqueeze", "Reshape", "Cast", "Expand", "Identity"):
            return None
        tensor = node.inputs[0]
    return None


def _seq_from(feeds: dict) -> int:
    ids = feeds.get("input_ids")
    return ids.shape[-1] if ids is not None else next(iter(feeds.values())).shape[-1]


def _minus_one(e: Emit, like: gs.Tensor) -> gs.Constant:
    dtype = np.dtype(like.dtype) if like.dtype is not None else np.dtype(np.float32)
    return e.const("minus_one", np.array(-1.0, dtype))


def _full_width(table: np.ndarray) -> bool:
    """cos(Concat(f, f)) repeats its first half; the fused ops' caches hold one half only."""
    half = table.shape[1] // 2
    return table.shape[1] % 2 == 0 and np.array_equal(table[:, :half], table[:, half:])


def _position_source(node: gs.Node) -> gs.Tensor | str:
    """The one graph input or Range output that `node` depends on (constants aside)."""
    sources, seen, stack = {}, set(), [node]
    while stack:
        n = stack.pop()
        for t in n.inputs:
            if id(t) in seen or constant_of(t) is not None:
                continue
            seen.add(id(t))
            producer = t.inputs[0] if t.inputs else None
            if producer is None or producer.op == "Range":
                sources[t.name] = t
            else:
                stack.append(producer)
    if len(sources) != 1:
        return f"{node.op} depends on {sorted(sources) or 'no input'}, expected one position source " \
               "(bind shapes and fold first)"
    return next(iter(sources.values()))


def _hoisted(node: gs.Node) -> gs.Tensor:
    """The Cos/Sin output followed through no-op Casts and Mul/Div by a constant (attention scaling)."""
    out = node.outputs[0]
    while len(out.outputs) == 1:
        nxt = out.outputs[0]
        if nxt.op == "Cast" or (nxt.op in ("Mul", "Div") and nxt.inputs[0] is out
                                and constant_of(nxt.inputs[1]) is not None) or \
                (nxt.op == "Mul" and constant_of(nxt.inputs[0]) is not None):
            out = nxt.outputs[0]
        else:
            break
    return out


def _max_positions(ctx: Context, source: gs.Tensor) -> int | str:
    opts = ctx.options
    if opts.max_positions:
        return int(opts.max_positions)
    if opts.seq_len:
        return int(opts.seq_len) + int(opts.cache_len or 0)
    return "table size unknown: give --seq-len (and --cache-len) or the max_positions option"


def _evaluate(graph: gs.Graph, ctx: Context, source: gs.Tensor, targets: list, max_pos: int):
    """[(table [max_pos, F], rank of the target)] by running source -> targets on 0..max_pos-1."""
    from mtkc.ir.execute import run

    sub = graph.copy()
    tensors = sub.tensors()
    pos = tensors[source.name]
    pos.inputs.clear()
    rank = len(source.shape) if source.shape is not None else 1
    dtype = np.dtype(source.dtype) if source.dtype is not None else np.dtype(np.int64)
    pos.dtype, pos.shape = dtype, [1] * (rank - 1) + [max_pos]
    sub.inputs = [pos]
    sub.outputs = [tensors[t.name] for t in targets]
    for out in sub.outputs:
        out.shape = None
        out.dtype = out.dtype or np.float32
    sub.cleanup(remove_unused_graph_inputs=False)
    loose = sorted({t.name for n in sub.nodes for t in n.inputs
                    if isinstance(t, gs.Variable) and not t.inputs and t is not pos and t.name})
    if loose:
        return f"cos/sin also depend on {loose} (bind shapes and fold first)"
    try:
        values = run(sub, {pos.name: np.arange(max_pos, dtype=dtype).reshape(pos.shape)}, ctx.root)
    except Exception as exc:  # onnxruntime reports a bad subgraph as a plain exception
        return f"cannot evaluate cos/sin for {max_pos} positions: {str(exc).splitlines()[0][:200]}"
    tables = []
    for out in sub.outputs:
        v = values[out.name]
        if v.ndim < 2 or v.shape[-2] != max_pos or int(np.prod(v.shape[:-2])) != 1:
            return f"cos/sin has shape {list(v.shape)} for {max_pos} positions, expected [.., {max_pos}, F]"
        tables.append((v.reshape(max_pos, v.shape[-1]).astype(np.float32), v.ndim))
    return tables


def _gather(graph, prefix, kind, table, source, rank, target):
    e = Emit(graph, prefix)
    src_rank = len(source.shape) if source.shape is not None else 1
    out = e.op("Gather", [e.const(f"{kind}_{TABLE}", table), source], {"axis": 0}, dtype=np.float32)
    if rank > src_rank + 1:
        axes = np.arange(rank - src_rank - 1, dtype=np.int64)
        out = e.op("Unsqueeze", [out, e.const("axes", axes)], dtype=np.float32)
    out.shape = target.shape
    return out


# -- fused RotaryEmbedding -> rotate-half ----------------------------------------------------------
def _decompose(graph: gs.Graph, node: gs.Node) -> str | None:
    """Rewrite one fused RotaryEmbedding; returns why not."""
    if node.attrs.get("interleaved", 0):
        return "interleaved RoPE is not rewritten"
    contrib = node.domain == MS
    x = node.inputs[0]
    if contrib:
        pos, cos, sin = node.inputs[1], node.inputs[2], node.inputs[3]
    else:
        cos, sin = node.inputs[1], node.inputs[2]
        pos = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    heads = int(node.attrs.get("num_heads", 0))
    rank = len(x.shape) if x.shape is not None else None
    if rank not in (3, 4):
        return f"input rank {rank} unknown or not 3/4"
    half = cos.shape[-1] if cos.shape is not None else None
    width = x.shape[-1]
    if isinstance(half, int):
        head = 2 * half
    elif isinstance(width, int) and (rank == 4 or heads):
        head = width if rank == 4 else width // heads
    else:
        return "head size unknown (no static cos_cache width or hidden size)"
    if rank == 3 and not heads:
        return "3-D input needs num_heads"
    rot_dim = int(node.attrs.get("rotary_embedding_dim", 0))
    if rot_dim not in (0, head):
        return f"partial rotary ({rot_dim} of {head}) is not rewritten"
    e = Emit(graph, node.name)
    f32 = x.dtype

    xin = e.op("Reshape", [x, e.ints("heads", 0, 0, heads, head)], dtype=f32) if rank == 3 else x
    halves, axis = [], 2 if rank == 3 else 1
    for kind, cache in (("cos", cos), ("sin", sin)):
        index = small_values(pos) if pos is not None else np.array(0)
        table = values_of(cache) if index is not None else None
        if table is not None:  # folded positions: the rows are constants
            rows = table[index] if pos is not None else table
            halves.append(e.const(kind, np.expand_dims(np.concatenate([rows, rows], -1), axis)))
            continue
        rows = e.op("Gather", [cache, pos], {"axis": 0}, dtype=f32) if pos is not None else cache
        full = e.op("Concat", [rows, rows], {"axis": -1}, dtype=f32)
        halves.append(e.op("Unsqueeze", [full, e.ints("axis", axis)], dtype=f32))
    lo = e.op("Slice", [xin, e.ints("s", 0), e.ints("e", head // 2), e.ints("a", -1)], dtype=f32)
    hi = e.op("Slice", [xin, e.ints("s", head // 2), e.ints("e", head), e.ints("a", -1)], dtype=f32)
    flipped = e.op("Mul", [hi, _minus_one(e, x)], dtype=f32)
    rotated = e.op("Concat", [flipped, lo], {"axis": -1}, dtype=f32)
    y = e.op("Add", [e.op("Mul", [xin, halves[0]], dtype=f32), e.op("Mul", [rotated, halves[1]], dtype=f32)], dtype=f32)
    if rank == 3:
        y = e.op("Reshape", [y, e.ints("flat", 0, 0, -1)], dtype=f32)
    out = node.outputs[0]
    y.shape = out.shape
    replace_uses(graph, out, y)
    node.outputs.clear()
    return None
