"""Attention mask: one additive float input replaces the causal + padding mask construction.

Exports build a BOOL [B,1,T,C+T] mask from the 2-D attention_mask (Range / LessOrEqual / And /
Gather or GatherND / Expand) and add it to the scores per layer as Where(mask, 0, -inf|finfo.min)
or Mul(Cast(Not(mask)), finfo.min). MDLA has none of that (bool, int64, Range, GatherND), and
-inf / finfo.min break fp16 and int16 quantisation. MediaTek's runtime builds the mask on the host.

Matched (rule FromInput, anchor: each Softmax; `start` finds M's tensors, the guards and what else
reads the 2-D input, `rewrite` swaps M for the new input in place, `finish` drops the guards and input):

    scores ─┐
    M ──────┴─ Add ─ Softmax          M derived from the 2-D attention_mask input
    Where(cond, scores, -big) ─ Softmax   (masked_fill form; cond derived from it)

Emitted: a graph input `attention_mask` float32 [1, 1, T, C+T] (T = seq_len, C = cache_len, 0
without cache), 0 where a key is visible and `mask_value` (`mtkc.contract.mask`: default and builder) where it is not,
feeding every site's Add; sites whose mask hides keys older than a window W (sliding-window
layers, measured by `mask_window`) get `attention_mask_window_<W>` of the same shape instead. The guards that zero fully-masked rows, Where(c, 0, x) with c derived
from the mask, go (a finite mask has no fully-masked row), and the 2-D input is removed.
Refused, leaving the graph untouched: a 2-D mask that something else still needs (unbound
shapes with a cache; without one, its Shape readers move to input_ids, which has its shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map, padding_mask
from mtkc.contract import cache as contract_cache
from mtkc.contract import io
from mtkc.contract import mask as contract_mask
from mtkc.ir.constants import values as small_values
from mtkc.ir.graph_utils import cleanup
from mtkc.ir.toposort import toposort
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.guards import drop, row_guards
from mtkc.rewrite.pass_api import Context, Miss, PassResult, register
from mtkc.rewrite.pattern import Match, Refused
from mtkc.rewrite.rules import Rule, RulePass, apply
from mtkc.passes import mask_window

NAME = io.ATTENTION_MASK
_QDQ = ("QuantizeLinear", "DequantizeLinear")


def _downstream(tensors: list[gs.Tensor]) -> set[int]:
    """ids of every tensor whose values depend on `tensors` (a Shape reads no values)."""
    seen, stack = {id(t) for t in tensors}, list(tensors)
    while stack:
        for node in stack.pop().outputs:
            if node.op == "Shape":
                continue
            for out in node.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    stack.append(out)
    return seen


@register
class Mask(RulePass):
    name = "mask"
    description = "causal/padding mask construction -> one additive float attention_mask [1,1,T,C+T] input"

    def __init__(self):
        self.value = contract_mask.DEFAULT_VALUE
        self.replaced: str | None = None  # the removed 2-D input's name (map_feeds reads it)
        self.windows: list[int | None] = []  # the windows of the inputs made (None: attention_mask)
        self.span: int | None = None  # keys the window probe uses (default from the options)
        self.rules = (FromInput(self),)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        if padding_mask(graph) is None:  # nothing to replace (already an additive input, or no mask at all)
            return PassResult(notes=["no 2-D integer attention_mask input"])
        return super().run(graph, ctx)

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """The additive mask equivalent to the 2-D mask (batch 1): key j visible to query i iff
        attention_mask[j] and j <= C + i."""
        if not self.replaced or self.replaced not in feeds:
            return feeds
        feeds = dict(feeds)
        keep = np.asarray(feeds.pop(self.replaced))[0].astype(bool)
        total = keep.shape[0]
        seq = int(ctx.options.seq_len or _feed_seq(feeds) or total)
        for window in self.windows:
            feeds[io.window_mask(window)] = contract_mask.additive(seq, total, self.value, keep, window=window)[None, None]
        return feeds


class Site(Rule):
    """Each Softmax whose scores get the mask M (`derive` says which tensors are M's): its Add
    operand M becomes the new input in place, Where(cond, scores, -big) becomes Add(scores, new)."""

    anchor, sites = ("Softmax",), "mask"

    def derive(self, graph: gs.Graph) -> tuple[set[int], str]:
        """ids of the mask's tensors, and what they derive from (for the reasons)."""
        raise NotImplementedError

    span: int | None = None  # keys the window probe uses

    def added(self, graph: gs.Graph, ctx: Context, window: int | None) -> gs.Variable:
        """The new additive input of the sites with `window` (made at their first rewrite)."""
        raise NotImplementedError

    def start(self, graph: gs.Graph, ctx: Context) -> None:
        derived, label = self.derive(graph)
        self.found = {id(n): _site(n, derived, label) for n in graph.nodes if n.op == "Softmax"}
        self.guards = list({id(n): (n, d) for n, d in row_guards(graph) + _guards(graph, derived)}.values())
        self.new: dict[int | None, gs.Variable] = {}
        self.cast: dict[tuple, gs.Tensor] = {}  # (window, dtype) -> the input cast for fp16 scores
        self.windows = self._windows(graph, ctx)

    def _windows(self, graph: gs.Graph, ctx: Context) -> dict[int, int | None]:
        """id(Softmax) -> its layer's window (None: global); a mask no window explains refuses its site."""
        sites = {k: s for k, s in self.found.items() if isinstance(s, tuple)}
        masks = {k: (node.inputs[i], True) if node.op == "Add" else (node.inputs[0], False) for k, (node, i) in sites.items()}
        span = self.span or ((ctx.options.seq_len or contract_cache.DEFAULT_SEQ_LEN)
                             + (ctx.options.cache_len or contract_cache.DEFAULT_CACHE_LEN))
        found = mask_window.probe(graph, list(masks.values()), span, ctx.root)
        windows = {}
        for k, (tensor, _) in masks.items():
            if tensor.name in found.refused:
                self.found[k] = Miss(sites[k][0].name, f"its mask is neither causal nor a sliding window: "
                                                      f"{found.refused[tensor.name]}{_infinite_scale(tensor)}")
            else:
                windows[k] = found.windows.get(tensor.name)
        return windows

    def check(self, ctx: Context, m: Match) -> None:
        site = self.found[id(m.anchor)]
        if isinstance(site, Miss):
            raise Refused(site.reason)

    def prefix(self, m: Match) -> str:
        return self.found[id(m.anchor)][0].name

    def rewrite(self, op: Emit, ctx: Context, m: Match) -> list[tuple[gs.Tensor, gs.Tensor]]:
        site, index = self.found[id(m.anchor)]
        window = self.windows.get(id(m.anchor))
        if window not in self.new:
            self.new[window] = self.added(op.graph, ctx, window)
        scores = site.inputs[1 - index] if site.op == "Add" else site.inputs[1]
        mask = self._as(op, window, scores.dtype)
        if site.op == "Add":
            site.inputs[index] = mask
            return []
        return [(site.outputs[0], op.Add(site.inputs[1], mask))]

    def _as(self, op: Emit, window: int | None, dtype) -> gs.Tensor:
        """The window's float32 input, cast once to the scores' dtype when they are another float (fp16 exports)."""
        new = self.new[window]
        if dtype is None or np.dtype(dtype) == np.float32 or not np.issubdtype(np.dtype(dtype), np.floating):
            return new
        key = (window, np.dtype(dtype).name)
        if key not in self.cast:
            self.cast[key] = op.Cast(new, to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                     _dtype=np.dtype(dtype), _shape=new.shape)
        return self.cast[key]

    def finish(self, graph: gs.Graph, ctx: Context, result: PassResult) -> None:
        """The guards go (a guard the rewrites left dead went with them, and still counts)."""
        if any(w is not None for w in self.new):
            counts = [sum(1 for k, s in self.found.items() if isinstance(s, tuple) and self.windows.get(k) == w)
                      for w in self.new]
            result.notes.append("sliding-window attention: " + ", ".join(
                f"{n} global ({io.window_mask(w)})" if w is None else f"{n} with window {w} ({io.window_mask(w)})"
                for w, n in zip(self.new, counts)))
        if self.new:
            result.rewrites += len(self.guards)
            drop(graph, [(n, d) for n, d in self.guards if n.outputs])
            toposort(cleanup(graph))


class FromInput(Site):
    """M derived from the 2-D integer mask input, which leaves the graph. Refused, untouched, when
    something else still reads it (its Shape readers move to input_ids when there is no cache)."""

    def __init__(self, owner: Mask):
        self.owner = owner

    def derive(self, graph):
        self.old = padding_mask(graph)
        others = [t for t in graph.inputs if t is not self.old]
        return _downstream([self.old]) - _downstream(others), self.old.name

    def start(self, graph, ctx):
        self.span = self.owner.span
        super().start(graph, ctx)
        sites = [s for s in self.found.values() if isinstance(s, tuple)]
        self.readers = _readers_left(graph, self.old, sites, self.guards) if sites else []
        self.shapes = _shape_source(graph, ctx) if all(r.op == "Shape" for r in self.readers) else None
        self.blocked = bool(self.readers) and self.shapes is None

    def candidate(self, node):
        return not (self.blocked and isinstance(self.found.get(id(node)), tuple))

    def added(self, graph, ctx, window):
        if not self.new:
            for reader in self.readers:  # no cache: the mask is [batch, seq], like input_ids
                reader.inputs[0] = self.shapes
            self.owner.value = contract_mask.value_of(ctx.options)
            self.owner.replaced = self.old.name
            self.owner.windows = []
            self.old.name = f"{self.old.name}.2d"  # the new input takes the name; the old one leaves the graph
        self.owner.windows.append(window)
        return _additive_input(graph, ctx, self.old.shape[1] if _has_cache(graph, ctx) else None, window)

    def finish(self, graph, ctx, result):
        if self.blocked:
            result.misses.append(Miss(self.readers[0].name, f"'{self.old.name}' would still be read by "
                                                            f"{len(self.readers)} node(s) (bind shapes and fold first)"))
        if self.new:
            result.rewrites += len(self.readers)
            super().finish(graph, ctx, result)
            graph.inputs = [t for t in graph.inputs if t is not self.old]


class FromShapes(Site):
    """M computed from shapes alone (no mask input reaches it)."""

    def derive(self, graph):
        varying = _downstream(list(graph.inputs))
        return {id(t) for node in graph.nodes for t in node.outputs if id(t) not in varying}, "shapes"

    def added(self, graph, ctx, window):
        return _additive_input(graph, ctx, None, window)


def _additive_input(graph: gs.Graph, ctx: Context, total, window: int | None = None) -> gs.Variable:
    """The new `attention_mask` (`attention_mask_window_<W>`) float input (see `additive_shape`)."""
    new = gs.Variable(io.window_mask(window), dtype=np.float32, shape=additive_shape(graph, ctx, total))
    graph.inputs.append(new)
    return new


def additive_shape(graph: gs.Graph, ctx: Context, total=None) -> list:
    """[1, 1, T, C+T] (symbols where not bound yet): the additive mask input's shape; `total`,
    the key length when it is known and no cache length is set."""
    seq = ctx.options.seq_len or _seq_dim(graph)
    # --cache-len is moot for a model without a cache, unless kv-cache is about to insert one
    cached = ctx.options.kv_cache or _has_cache(graph, ctx)
    cache = ctx.options.cache_len if cached else None
    if cache is not None:
        total = int(seq) + int(cache) if isinstance(seq, int) or str(seq).isdigit() else f"{cache}+{seq}"
    elif total is None:
        total = "total_sequence_length" if cached else seq
    return [1, 1, seq, total]


@dataclass
class ImplicitMask:
    """The additive input(s) that replaced a mask computed from shapes alone (no mask input)."""

    name: str
    value: float
    windows: tuple = (None,)  # one input per window (None: `name`, the global mask)

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """What the export attended: every key up to the query's own position (past P + i), within the window."""
        seq = int(_feed_seq(feeds) or 1)
        past = next((np.asarray(v).shape[2] for k, v in sorted(feeds.items())
                     if k.startswith("past_") and np.ndim(v) == 4), 0)
        return {**feeds, **{io.window_mask(w): contract_mask.additive(seq, past + seq, self.value, window=w)[None, None]
                            for w in self.windows}}


def implicit_mask(graph: gs.Graph, ctx: Context, span: int | None = None) -> ImplicitMask | None:
    """An export with no mask input whose attention adds a mask computed from shapes alone (e.g.
    transformers' generation export: Range/LessOrEqual/Not/Cast/Mul, the row guard from
    Less(ReduceSum)): that mask becomes the standard additive input; None when there is none."""
    if padding_mask(graph) is not None or any(t.name == NAME for t in graph.inputs):
        return None
    rule = FromShapes()
    rule.span = span
    apply(rule, graph, ctx, PassResult())
    if not rule.new:
        return None
    return ImplicitMask(NAME, contract_mask.value_of(ctx.options), tuple(rule.new))


def _site(softmax: gs.Node, derived: set[int], mask: str):
    """(Add, index of its mask input) or (Where(cond, scores, -big), 0) feeding `softmax` (through the
    Q/DQ pair a QDQ model puts on every activation), else a Miss."""
    site = softmax.inputs[0].inputs[0] if softmax.inputs[0].inputs else None
    while site is not None and site.op in _QDQ:
        site = site.inputs[0].inputs[0] if site.inputs[0].inputs else None
    if site is not None and site.op == "Add":
        masked = [i for i, t in enumerate(site.inputs) if id(t) in derived]
        if len(masked) == 1:
            return site, masked[0]
        return Miss(site.name, f"{len(masked)} Add inputs derive from '{mask}', expected 1")
    if site is not None and site.op == "Where":
        if id(site.inputs[0]) in derived and id(site.inputs[1]) not in derived:
            return site, 0
        return Miss(site.name, f"Where condition does not derive from '{mask}'")
    return Miss(softmax.name, f"Softmax input is not an Add or a Where ({site.op if site else 'none'})")


def _infinite_scale(mask: gs.Tensor) -> str:
    """Why a QDQ model's mask is no mask: its DequantizeLinear's scale is not finite (calibrated on
    the mask's finfo.min range, the scale overflowed), so it is NaN where visible and -inf where not."""
    node = mask.inputs[0] if mask.inputs else None
    scale = small_values(node.inputs[1]) if node is not None and node.op == "DequantizeLinear" else None
    if scale is None or np.isfinite(scale).all():
        return ""
    return (f" (DequantizeLinear '{node.name}' has scale {scale.ravel()[0]}: the quantised mask is NaN/-inf, so the "
            "model's own attention is; quantise without the mask, e.g. nodes_to_exclude)")


def _guards(graph: gs.Graph, derived: set[int]) -> list[tuple[gs.Node, gs.Tensor]]:
    """Where(c, 0, x) with c derived from the mask and x not: a fully-masked-row guard."""
    guards = []
    for node in graph.nodes:
        if node.op != "Where" or not node.outputs or node.outputs[0] in graph.outputs:
            continue
        cond, zero, data = node.inputs
        z = small_values(zero)
        if id(cond) in derived and id(data) not in derived and z is not None and z.size == 1 and not z.any():
            guards.append((node, data))
    return guards


def _readers_left(graph: gs.Graph, old: gs.Tensor, sites, guards) -> list[gs.Node]:
    """Readers of `old` still needed for the graph outputs once the sites and guards are rewired."""
    cut = {id(site.inputs[i]) for site, i in sites if site.op == "Add"}
    bypass = {id(node): data for node, data in guards}
    where = {id(site): site.inputs[1] for site, _ in sites if site.op == "Where"}
    needed, stack, seen = [], list(graph.outputs), set()
    while stack:
        t = stack.pop()
        if id(t) in seen or id(t) in cut or not t.inputs:
            continue
        seen.add(id(t))
        node = t.inputs[0]
        inputs = [bypass[id(node)]] if id(node) in bypass else [where[id(node)]] if id(node) in where else node.inputs
        if any(i is old for i in inputs):
            needed.append(node)
        stack.extend(inputs)
    return list({id(n): n for n in needed}.values())


def _shape_source(graph: gs.Graph, ctx: Context) -> gs.Tensor | None:
    """A 2-D graph input with the mask's shape [batch, seq]: input_ids, when there is no cache."""
    if _has_cache(graph, ctx):
        return None
    return next((t for t in graph.inputs if t.name == "input_ids" and t.shape is not None and len(t.shape) == 2), None)


def _seq_dim(graph: gs.Graph):
    ids = next((t for t in graph.inputs if t.name == "input_ids"), None)
    return ids.shape[1] if ids is not None and ids.shape is not None else "sequence_length"


def _has_cache(graph: gs.Graph, ctx: Context) -> bool:
    return ctx.analysis(decoder_map, graph).cached


def _feed_seq(feeds: dict) -> int | None:
    for name in ("input_ids", "hidden_states"):
        if name in feeds:
            return np.asarray(feeds[name]).shape[1]
    return None
