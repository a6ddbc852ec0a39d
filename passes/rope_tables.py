"""cos/sin hoisting: RoPE's Cos and Sin (unsupported on every MDLA) become a table lookup or an input.

Matched (rule Hoist, anchor: each Cos / Sin): the subgraph from the position source (position_ids
input, or a Range) to the cos/sin tensor, followed through no-op Casts and constant scalings —
inv_freq, rope_theta, attention scaling as the export has them:

    position_ids ─ ... ─ MatMul(inv_freq) ─ ... ─ Cos ─ [Cast] ─ [Mul(scale)] ─ cos
                                             └─── Sin ─ [Cast] ─ [Mul(scale)] ─ sin

It is *evaluated* in onnxruntime for positions 0..max_pos-1 (one run per position source) and
replaced, per option `rope_mode`, by:

    table   Gather(cos_table[max_pos, F], positions)                 max_pos = option max_positions
                                                                      or cache_len + seq_len
    pos_emb a graph input pos_emb [1, 2, T, D] (cos, sin: MediaTek's convention), sliced
            Squeeze(Slice(pos_emb, 0:1 | 1:2, axis 1)); position_ids is then dropped.

Left open (rope_mode unset), the mode is `table` unless the SDK makes that Gather a host lookup
(a table of more rows than its Gather limit) and every target is [1, T, D]: then `pos_emb`. The
Rope pass keeps the mode used and `better`, the mode that places better when it is not the one
given, with why (check's suggestion).

Rule FoldedToPosEmb (pos_emb only, on rope.RotateHalf's sites): cos/sin that shape folding already
made constants (no cache: positions 0..T-1) become pos_emb slices too, so every graph variant
takes the same inputs.

Refused: cos/sin depending on more than one position source (bind shapes first), no table size
(give seq_len/cache_len or max_positions), or a result that is not [.., positions, F].
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.contract import io
from mtkc.ir.constants import constant_of, values
from mtkc.ir.execute import run
from mtkc.ir.graph_utils import cleanup, tensor_map
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.markers import ROPE_TABLE
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule

POS_EMB = io.POS_EMB
MODES = ("table", "pos_emb")


class Hoist(Rule):
    anchor, sites = ("Cos", "Sin"), "cos/sin"

    def __init__(self, io):
        self.io = io  # the Rope pass: `tables` and `position_input` for its map_feeds

    def start(self, graph, ctx):
        """Evaluate every cos/sin once per position source: node id -> (target, table, rank, source) | Refused."""
        self.plan, groups = {}, {}
        given = ctx.options.rope_mode
        for node in graph.nodes:
            if node.op not in self.anchor or node.domain:
                continue
            if given not in (None, *MODES):
                self.plan[id(node)] = Refused(f"unknown rope_mode '{given}' (table | pos_emb)")
                continue
            try:
                source = _position_source(node)
            except Refused as why:
                self.plan[id(node)] = why
                continue
            groups.setdefault(id(source), (source, []))[1].append((node, _hoisted(node)))
        for source, items in groups.values():
            try:
                tables = _evaluate(graph, ctx, source, [t for _, t in items], _max_positions(ctx))
            except Refused as why:
                tables = [why] * len(items)
            for (node, target), table in zip(items, tables):
                self.plan[id(node)] = table if isinstance(table, Refused) else (target, *table, source)
        self.io.better = _better(ctx, [p for p in self.plan.values() if not isinstance(p, Refused)], given)
        self.io.mode = given or (self.io.better[0] if self.io.better else "table")

    def check(self, ctx, m):
        if isinstance(plan := self.plan[id(m["node"])], Refused):
            raise plan

    def rewrite(self, op, ctx, m):
        node = m["node"]
        target, table, rank, source = self.plan[id(node)]
        kind = "cos" if node.op == "Cos" else "sin"
        if self.io.mode == "table":
            return [(target, _gather(op, kind, table.astype(_float(target)), source, rank))]
        if rank != 3:
            raise Refused(f"{kind} is rank {rank}, pos_emb replaces [1, T, D] tensors only")
        full = table if _full_width(table) else np.concatenate([table, table], axis=-1)
        if any(t is source for t in m.graph.inputs):
            self.io.position_input = source.name
        seq = ctx.options.seq_len or (source.shape[-1] if source.shape else "sequence_length")
        return [(target, _as(op, _slice(op, self.io, kind, full, table.shape[1], seq, target.shape), _float(target)))]


class FoldedToPosEmb(Rule):
    """cos/sin already folded to constants (positions 0..T-1, no cache) -> pos_emb slices."""

    sites, quiet = "folded cos/sin", True

    def __init__(self, io, rotate_half: Rule):
        self.io, self.anchor, self.root, self.steps = io, rotate_half.anchor, rotate_half.root, rotate_half.steps
        self.candidate, self.pattern = rotate_half.candidate, rotate_half.pattern

    def applies(self, ctx):
        return self.io.mode == "pos_emb"

    def check(self, ctx, m):
        for kind in ("cos", "sin"):
            const = _constant_source(m[kind])
            shape = list(const.shape) if const is not None else []
            width = shape[-1] if len(shape) in (3, 4) else 0
            seq = int(np.prod(shape)) // width if width else 0
            if const is not None and (not width or sorted(d for d in shape if d != 1) not in (sorted([seq, width]), [width])):
                raise Refused(f"constant {kind} has shape {shape}")

    def done(self, ctx, m):
        return all(_constant_source(m[kind]) is None for kind in ("cos", "sin"))

    def prefix(self, m):
        return m["add"].name

    def rewrite(self, op, ctx, m):
        replaced = []
        for kind in ("cos", "sin"):
            const = _constant_source(m[kind])
            if const is not None:
                vals = np.asarray(values(const, ctx.read_values))
                width = vals.shape[-1]
                replaced.append((const, _as(op, _slice(op, self.io, kind, vals.reshape(-1, width).astype(np.float32), width,
                                                           vals.size // width, vals.shape), vals.dtype)))
        return replaced


def _float(target: gs.Tensor) -> np.dtype:
    """The dtype the replaced cos/sin had (fp16 exports compute RoPE in fp16); float32 when untyped."""
    return np.dtype(target.dtype) if target.dtype is not None else np.dtype(np.float32)


def _as(op: Emit, tensor: gs.Tensor, dtype: np.dtype) -> gs.Tensor:
    """`tensor` (float32: pos_emb is a float32 input by contract) cast to `dtype` when that differs."""
    if dtype == np.float32:
        return tensor
    return op.Cast(tensor, to=onnx.helper.np_dtype_to_tensor_dtype(dtype), _dtype=dtype, _shape=tensor.shape)


def _better(ctx, plans: list[tuple], given: str | None) -> tuple[str, str] | None:
    """(mode, why) when one mode places the cos/sin lookups better and it is not `given`: `pos_emb`
    when the table Gather is a host lookup on the SDK and every target is [1, T, D]; `table` when
    `pos_emb` cannot replace a target and the Gather stays on the NPU."""
    if ctx.table is None or not plans:
        return None
    target, table, rank, source = plans[0]
    probe = gs.Node("Gather", inputs=[gs.Constant(f"cos_{ROPE_TABLE}", table), source],
                    outputs=[gs.Variable("probe", dtype=np.float32)], attrs={"axis": 0})
    verdict = ctx.table.verdict(probe)
    probe.inputs.clear()  # a Node hooks itself onto its tensors: unhook, the graph is unchanged
    probe.outputs.clear()
    host = not verdict.supported and verdict.target == "host"
    fits = all(p[2] == 3 for p in plans)
    if host and fits and given != "pos_emb":
        return "pos_emb", f"the table Gather is a host lookup on SDK {ctx.sdk} ({verdict.detail})"
    if not host and not fits and given == "pos_emb":
        return "table", f"pos_emb replaces [1, T, D] cos/sin only; {target.name} is rank {rank}"
    return None


def _constant_source(tensor: gs.Tensor) -> gs.Constant | None:
    """The constant a cos/sin operand is computed from through shape-only ops, if any (and still
    read: an earlier site may have replaced a constant it shares with this one)."""
    for _ in range(4):
        if isinstance(tensor, gs.Constant):
            return tensor if tensor.outputs else None
        node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if node is None or node.op not in ("Unsqueeze", "Reshape", "Cast", "Expand", "Identity"):
            return None
        tensor = node.inputs[0]
    return None


def _slice(op: Emit, io, kind, full, width, seq, shape):
    """Slice(pos_emb, cos|sin, first `width` columns) [1,1,T,width], reshaped to `shape` when it differs."""
    graph = op.graph
    pos_emb = next((t for t in graph.inputs if t.name == POS_EMB), None)
    if pos_emb is None:
        pos_emb = gs.Variable(POS_EMB, dtype=np.float32, shape=[1, 2, seq, full.shape[1]])
        graph.inputs.append(pos_emb)
    elif pos_emb.shape[-1] != full.shape[1]:
        raise Refused(f"pos_emb has width {pos_emb.shape[-1]}, {kind} needs {full.shape[1]}")
    io.tables[kind] = full
    k = 0 if kind == "cos" else 1
    sliced = op.Slice(pos_emb, op.ints("starts", k, 0), op.ints("ends", k + 1, width), op.ints("axes", 1, 3),
                      _dtype=np.float32, _shape=[1, 1, seq, width])
    shape = list(shape) if shape is not None else None
    if shape == [1, 1, seq, width]:
        return sliced
    if shape is not None and all(isinstance(d, int) for d in shape):  # [1, T, D] or [1, T, 1, D] (BSND)
        return op.Reshape(sliced, op.ints("shape", *shape), _shape=shape)
    return op.Squeeze(sliced, op.ints("axes", 1), _shape=shape)


def _full_width(table: np.ndarray) -> bool:
    """cos(Concat(f, f)) repeats its first half; the fused ops' caches hold one half only."""
    half = table.shape[1] // 2
    return table.shape[1] % 2 == 0 and np.array_equal(table[:, :half], table[:, half:])


def _position_source(node: gs.Node) -> gs.Tensor:
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
        raise Refused(f"{node.op} depends on {sorted(sources) or 'no input'}, expected one position source "
                      "(bind shapes and fold first)")
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


def _max_positions(ctx) -> int:
    opts = ctx.options
    if opts.max_positions:
        return int(opts.max_positions)
    if opts.seq_len:
        return int(opts.seq_len) + int(opts.cache_len or 0)
    raise Refused("table size unknown: give --seq-len (and --cache-len) or the max_positions option")


def _evaluate(graph: gs.Graph, ctx, source: gs.Tensor, targets: list, max_pos: int) -> list[tuple[np.ndarray, int]]:
    """[(table [max_pos, F], rank of the target)] by running source -> targets on 0..max_pos-1."""
    sub = _copy_upstream(graph, targets)
    tensors = tensor_map(sub)
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
    cleanup(sub)
    loose = sorted({t.name for n in sub.nodes for t in n.inputs
                    if isinstance(t, gs.Variable) and not t.inputs and t is not pos and t.name})
    if loose:
        raise Refused(f"cos/sin also depend on {loose} (bind shapes and fold first)")
    try:
        results = run(sub, {pos.name: np.arange(max_pos, dtype=dtype).reshape(pos.shape)}, ctx.root)
    except Exception as exc:  # onnxruntime reports a bad subgraph as a plain exception
        raise Refused(f"cannot evaluate cos/sin for {max_pos} positions: {str(exc).splitlines()[0][:200]}") from None
    tables = []
    for out in sub.outputs:
        v = results[out.name]
        if v.ndim < 2 or v.shape[-2] != max_pos or int(np.prod(v.shape[:-2])) != 1:
            raise Refused(f"cos/sin has shape {list(v.shape)} for {max_pos} positions, expected [.., {max_pos}, F]")
        tables.append((v.reshape(max_pos, v.shape[-1]).astype(np.float32), v.ndim))
    return tables


def _copy_upstream(graph: gs.Graph, targets: list) -> gs.Graph:
    """`graph.copy()` with only the nodes `targets` depend on (in graph order): what the cleanup of
    the copy keeps is the same, without copying the rest of the graph."""
    members = {id(n) for n in graph.nodes}
    need: set[int] = set()
    stack = list(targets)
    while stack:
        for p in stack.pop().inputs:
            if id(p) in members and id(p) not in need:
                need.add(id(p))
                stack.extend(p.inputs)
    nodes = graph.nodes
    graph.nodes = [n for n in nodes if id(n) in need]
    try:
        return graph.copy()
    finally:
        graph.nodes = nodes


def _gather(op: Emit, kind, table, source, rank):
    src_rank = len(source.shape) if source.shape is not None else 1
    out = op.Gather(op.const(f"{kind}_{ROPE_TABLE}", table), source, axis=0, _dtype=table.dtype)
    if rank > src_rank + 1:
        out = op.Unsqueeze(out, op.const("axes", np.arange(rank - src_rank - 1, dtype=np.int64)), _dtype=table.dtype)
    return out
