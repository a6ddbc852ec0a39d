"""KV cache: a decoder export -> static prefill / decode graphs over a fixed-size cache.

How compile uses this module (`mtkc.pipeline.compile`): `variants(graph, options)` plans the graphs,
and the pipeline runs once per variant on a fresh load, all graphs through one WeightWriter:
    model                       a model without KV cache (options kv_cache False, or None and
                                no cache inputs)
    prefill, decode             seq_len T (default 128) / 1, both cache_len C (default 512)
    prefill_<k>, decode_<k>     with chunks N > 1, k = 0..N-1
Overrides per variant: kv_cache, variant, seq_len, cache_len, cache_io, chunks, chunk,
max_positions (C + T for both, so RoPE tables are the same constant). Pipeline order:
`kv-cache` first (before bind-shapes: a no-cache export still computes its shapes with Shape
ops, so an inserted past concat propagates), `kv-cache-io` and `layer-chunks` last.

Three passes, one idea (the cache contract of MediaTek's LLM runtime, ExecuTorch mediatek/):

* `kv-cache` finds each layer's cache concat and names the cache I/O (shapes are bound later by
  `bind-shapes`: past_* -> [1,Hkv,C,D]; the other LLM passes name and shape the rest):

      past_key_values.{i}.key ──► [Identity | Concat(1 input)]* ──► Concat(axis=2) ◄── K after RoPE
      (legacy/dynamo/optimum;  input.cache.layers.{i}.keys (hf);  past_key_{i})   │
                                                                                  ▼
                                                          present.{i}.key ─► attention
  ->  inputs  past_key_<i> / past_value_<i> [1,Hkv,C,D] (besides input_ids, attention_mask, ...)
      outputs logits [1,T,V], present_key_<i> / present_value_<i> = the concat [1,Hkv,C+T,D].
  In an export without cache I/O (see `insert_cache`): the mask pass runs first (its additive
  [1,1,T,C+T] mask replaces the [B,1,T,T] construction), K and V are cut where they enter
  attention (after RoPE, before repeat_kv), `Concat(past, new, axis=2)` is inserted, the
  repeat_kv/Kᵀ shape targets are made length-free, and RoPE reads a new `position_ids` input.
  Refuses (InputError) a model with neither cache inputs nor a Softmax attention (fused ops named).

* `kv-cache-io` makes the present outputs what the runtime keeps (`cache_io`):
      new      present_<kv>_<i> = the concat's `new` input      [1,Hkv,T,D] (runtime writes it in)
      sliding  present_<kv>_<i> = Slice(concat, T:C+T, axis 2)  [1,Hkv,C,D] (runtime feeds it back)

* `layer-chunks` keeps chunk k of N equal layer ranges: the residual stream tensor entering the
  chunk's first layer becomes input `hidden_states`, the one leaving its last layer output
  `hidden_states_out` (embedding stays in chunk 0, final norm + lm_head in chunk N-1). Layer
  boundaries are the dominators of the logits (paths from the token input, ignoring Shape
  edges) that dominate layer i's cache concat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import onnx_graphsurgeon as gs

from mtkc.contract import cache as layouts
from mtkc.contract import exporters, io
from mtkc.contract import mask as contract_mask
from mtkc.errors import InputError
from mtkc.ir import shapes
from mtkc.ir.constants import values as values_of
from mtkc.ir.graph_utils import Names as NodeNames
from mtkc.options import Options
from mtkc.rewrite.pass_api import Context, Pass, PassResult, register

DEFAULT_SEQ_LEN = layouts.DEFAULT_SEQ_LEN
DEFAULT_CACHE_LEN = layouts.DEFAULT_CACHE_LEN
CACHE_IO = layouts.LAYOUTS
KINDS = io.KINDS

_PASS_THROUGH = ("Identity",)


# ---------------------------------------------------------------------------- variants (compile)


@dataclass(frozen=True)
class Variant:
    """One graph a compile produces: its manifest name and the option overrides of its run."""

    name: str
    options: dict = field(default_factory=dict)


def variants(graph: gs.Graph, options: Options) -> list[Variant]:
    """The graphs to produce: `model`, or prefill/decode (per chunk) for a KV-cache decoder."""
    kv = options.kv_cache
    if kv is None:
        kv = bool(past_inputs(graph))
    if not kv:
        return [Variant("model", {})]
    seq_len = options.seq_len or DEFAULT_SEQ_LEN
    cache_len = options.cache_len or DEFAULT_CACHE_LEN
    cache_io = options.cache_io or "new"
    chunks = options.chunks or 1
    if cache_io not in CACHE_IO:
        raise InputError(f"--cache-io {cache_io}: expected one of {', '.join(CACHE_IO)}")
    if chunks < 1 or seq_len < 1 or cache_len < 1:
        raise InputError(f"--chunks/--seq-len/--cache-len must be >= 1 (got {chunks}/{seq_len}/{cache_len})")
    layers = len({i for i, _ in past_inputs(graph)}) or sum(1 for n in graph.nodes if n.op == "Softmax")
    if layers and layers % chunks:
        raise InputError(f"--chunks {chunks} does not divide the model's {layers} decoder layers evenly")
    max_pos = options.max_positions or seq_len + cache_len  # one RoPE table for both graphs
    out = []
    for variant, t in (("prefill", seq_len), ("decode", 1)):
        for k in range(chunks):
            name = variant if chunks == 1 else f"{variant}_{k}"
            out.append(Variant(name, dict(kv_cache=True, variant=variant, seq_len=t, cache_len=cache_len,
                                          cache_io=cache_io, chunks=chunks, chunk=k, max_positions=max_pos)))
    return out


# ---------------------------------------------------------------------------- finding the cache


def past_inputs(graph: gs.Graph) -> dict[tuple[int, str], gs.Variable]:
    """Cache inputs by (layer, "key"|"value"), recognised by exporter naming."""
    found = {}
    for tensor in graph.inputs:
        name = exporters.recognise(tensor.name)
        if name and name[0] == "past":
            found[(name[2], name[1])] = tensor
    return found


def cache_concat(past: gs.Tensor) -> gs.Node | None:
    """The `Concat(past, new, axis=2)` a cache input feeds, through Identity / 1-input Concat copies."""
    tensor = past
    for _ in range(8):
        nxt = None
        for node in tensor.outputs:
            if node.op == "Concat" and len(node.inputs) == 2 and node.inputs[0] is tensor:
                if node.attrs.get("axis") in (2, -2):
                    return node
            elif node.op in _PASS_THROUGH or (node.op == "Concat" and len(node.inputs) == 1):
                nxt = node.outputs[0]
        if nxt is None:
            return None
        tensor = nxt
    return None


def _dim(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{what}: dimension {value!r} is not static; bind it with --input-shape") from None


def _opts(ctx: Context) -> tuple[int, int, str]:
    t = ctx.options.seq_len or DEFAULT_SEQ_LEN
    c = ctx.options.cache_len or DEFAULT_CACHE_LEN
    return t, c, ctx.options.cache_io or "new"


def _kv_on(ctx: Context) -> bool:
    return bool(ctx.options.kv_cache)


# ---------------------------------------------------------------------------- kv-cache


@register
class KvCache(Pass):
    name = "kv-cache"
    description = "name the KV-cache I/O (past_key_<i> [1,Hkv,C,D], present_*), insert it in no-cache exports"

    def applies(self, ctx: Context) -> bool:
        return _kv_on(ctx)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        pasts = past_inputs(graph)
        notes = []
        self.inserted: dict[str, list] = {}  # no-cache export: new past inputs -> [Hkv, D]
        if pasts:
            layers = _existing_cache(graph, pasts)
        else:
            old_mask = next((t.name for t in graph.inputs if t.name == "attention_mask"), None)
            notes += _mask_first(graph, ctx)
            layers = insert_cache(graph, ctx.root)
            notes.append(f"no cache I/O in the export: inserted past concat in {len(layers)} attention layers")
            self.inserted = {l.past[k].name: [l.past[k].shape[1], l.past[k].shape[3]] for l in layers for k in KINDS}
            self.old_mask = old_mask
        self.renames = _name_io(graph, layers)
        return PassResult(rewrites=len(self.renames) if pasts else len(layers), notes=notes)

    def map_feeds(self, feeds, ctx):
        """Renamed cache inputs; a no-cache export gets an empty cache (all slots masked),
        positions 0..T-1 and the additive mask of its 2-D mask."""
        feeds = {self.renames.get(k, k): v for k, v in feeds.items()}
        if not self.inserted:
            return feeds
        ids = next(v for k, v in feeds.items() if k in ("input_ids", "hidden_states"))
        t, c = ids.shape[1], ctx.options.cache_len or DEFAULT_CACHE_LEN
        keep = np.asarray(feeds.pop(self.old_mask))[0].astype(bool) if self.old_mask in feeds else np.ones(t, bool)
        feeds["attention_mask"] = contract_mask.attention_mask(t, c, contract_mask.value_of(ctx.options), new=keep)
        feeds["position_ids"] = np.arange(t, dtype=np.int64)[None]
        if self.old_mask is not None:
            feeds[NEW_TOKEN_MASK] = keep.astype(np.int64)[None]
        for name, (hkv, d) in self.inserted.items():
            feeds[name] = np.zeros((1, hkv, c, d), np.float32)
        return feeds

    def map_outputs(self, outputs, ctx):
        return {self.renames.get(k, k): v for k, v in outputs.items()}


@dataclass
class LayerCache:
    index: int
    past: dict[str, gs.Variable]  # kind -> input
    concat: dict[str, gs.Node]  # kind -> Concat(past, new, axis=2)


def _existing_cache(graph: gs.Graph, pasts: dict) -> list[LayerCache]:
    indices = sorted({i for i, _ in pasts})
    if indices != list(range(len(indices))):
        raise InputError(f"cache inputs cover layers {indices}; expected 0..{len(indices) - 1}")
    layers = []
    for i in indices:
        layer = LayerCache(i, {}, {})
        for kind in KINDS:
            past = pasts.get((i, kind))
            if past is None:
                raise InputError(f"layer {i} has a past {KINDS[1 - KINDS.index(kind)]} input but no past {kind}")
            concat = cache_concat(past)
            if concat is None:
                raise InputError(f"cache input '{past.name}': no Concat(past, new, axis=2) consumes it")
            layer.past[kind], layer.concat[kind] = past, concat
        layers.append(layer)
    return layers


def _name_io(graph: gs.Graph, layers: list[LayerCache]) -> dict[str, str]:
    """Contract names for the cache I/O and outputs in contract order; returns {old: new name}.

    Shapes stay as exported (symbols): `bind-shapes` binds them by role (past_* -> cache_len).
    """
    renames = {}

    def rename(tensor: gs.Tensor, name: str) -> None:
        if tensor.name != name:
            renames[tensor.name] = name
            tensor.name = name

    presents = []
    for layer in layers:
        for kind in KINDS:
            past, concat = layer.past[kind], layer.concat[kind]
            rename(past, f"past_{kind}_{layer.index}")
            out = concat.outputs[0]
            rename(out, f"present_{kind}_{layer.index}")
            out.dtype = out.dtype or np.float32
            presents.append(out)
    logits = next((o for o in graph.outputs if o.name == "logits"), None)
    if logits is None:
        logits = graph.outputs[0]
        rename(logits, "logits")
    graph.outputs = [logits] + presents
    return renames


# ---------------------------------------------------------------------------- no-cache exports

# A no-cache export's 2-D mask, kept where exporters read the sequence length from its shape
# (dynamo, hf); renamed so that shape binding keeps it [1, T] (it is not the [1, C+T] mask).
NEW_TOKEN_MASK = "new_token_mask"
PROBE_SEQ = 97  # a sequence length no model dimension is likely to equal
_LAYOUT = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Tile"}
_FUSED_ATTENTION = {"MultiHeadAttention", "GroupQueryAttention", "Attention", "PackedAttention"}
_SCORE_PATH = {"Add", "Where", "Mul", "Div", "Cast", "Sub"}
_PROB_PATH = {"Cast", "Where", "IsNaN", "Identity"}


def _mask_first(graph: gs.Graph, ctx: Context) -> list[str]:
    """No-cache export: the mask pass runs now, while the mask is still [B,1,T,T]-consistent.

    Its additive `attention_mask` input is [1,1,T,C+T] from the start; the 2-D mask, when the
    export still reads its length as the sequence length, becomes `new_token_mask` [1, T].
    """
    from mtkc.passes.mask import Mask

    result = Mask().run(graph, ctx)
    ids = next((t for t in graph.inputs if t.name in ("input_ids", "hidden_states")), None)
    for t in graph.inputs:
        if t.name.startswith("attention_mask") and t.shape is not None and len(t.shape) == 2:
            t.name = NEW_TOKEN_MASK
            t.shape = [1, ids.shape[1] if ids is not None and ids.shape else "sequence_length"]
    return [f"mask: {m.node}: {m.reason}" for m in result.misses]


def insert_cache(graph: gs.Graph, root=None) -> list[LayerCache]:
    """Cut K and V where they enter each attention and splice `Concat(past, new, axis=2)` in.

        MatMul(Q, ·Kᵀ) ─ [Add mask | Where | Mul] ─ Softmax ─ [Where | Cast]* ─ MatMul(·, V)
        K/V entry: walk up from the MatMul operand through layout ops (Transpose, Reshape,
        Expand, Unsqueeze -- repeat_kv --, Mul by a constant scale) to the first other producer
        (RoPE's Add for K) or to the head split Transpose(0,2,1,3) (V): [B, Hkv, S, D].

    Reshape/Expand targets between the concat and the MatMul (repeat_kv, Kᵀ) are rewritten to
    constants with the KV length free (-1 / broadcast 1): exporters compute them from the
    *query* length (dynamo, hf), which no longer equals the KV length.
    Positions: a no-cache export counts them from 0 (Range); the Range feeding cos/sin is
    replaced by a new `position_ids` input, so decode rows get their real position.
    """
    shapes.infer(graph, root)
    sites = []
    for softmax in graph.nodes:
        if softmax.op != "Softmax":
            continue
        qk = _find(softmax.inputs[0], _SCORE_PATH, up=True)
        pv = _find(softmax.outputs[0], _PROB_PATH, up=False)
        if qk is None or pv is None:
            continue
        sites.append((_kv_entry(qk.inputs[1]), _kv_entry(pv.inputs[1])))
    if not sites:
        fused = sorted({n.op for n in graph.nodes if n.op in _FUSED_ATTENTION})
        raise InputError(
            "model has no KV-cache inputs (past_key_values.*) and no attention (MatMul -> Softmax -> MatMul) "
            "whose K/V could be cut; cannot build prefill/decode graphs"
            + (f" (attention is fused as {', '.join(fused)}: export with cache I/O, or without ORT fusions)"
               if fused else ""))
    probe = _probe_shapes(graph, root)
    names = NodeNames(graph)
    layers = []
    for i, entries in enumerate(sites):
        layer = LayerCache(i, {}, {})
        for kind, new in zip(KINDS, entries):
            shape = probe.get(new.name)
            if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1::2]):
                raise InputError(f"layer {i}: {kind} entry '{new.name}' has shape {shape}, expected [B, Hkv, S, D]"
                                 + _fused_entry(new))
            past = gs.Variable(f"past_{kind}_{i}", np.float32, ["batch_size", shape[1], "past_sequence_length", shape[3]])
            full = gs.Variable(f"kv_cache/{kind}_{i}", np.float32, None)
            concat = gs.Node("Concat", names.new(f"kv_cache/concat_{kind}_{i}"), {"axis": 2}, [past, new], [full])
            for node in list(new.outputs):
                if node is not concat:
                    for j, x in enumerate(node.inputs):
                        if x is new:
                            node.inputs[j] = full
            graph.nodes.append(concat)
            graph.inputs.append(past)
            _free_kv_length(full, probe, names)
            layer.past[kind], layer.concat[kind] = past, concat
        layers.append(layer)
    _position_input(graph, names, probe)
    return layers


def _probe_shapes(graph: gs.Graph, root=None) -> dict[str, list]:
    """Tensor shapes with every symbolic input dim set to 1 (batch) or PROBE_SEQ (the rest):
    static Hkv and D where symbolic inference leaves them unknown (TorchScript's runtime
    reshapes), and the sequence axis recognisable by its value."""
    probe = graph.copy()
    for t in probe.inputs:
        t.shape = [d if isinstance(d, int) else (1 if axis == 0 else PROBE_SEQ) for axis, d in enumerate(t.shape or [])]
        if t.name == "attention_mask" and len(t.shape) == 4:  # additive, no past yet: [1, 1, S, S]
            t.shape = [1, 1, PROBE_SEQ, PROBE_SEQ]
    shapes.infer(probe, root)
    return {name: t.shape for name, t in probe.tensors().items()}


def _free_kv_length(full: gs.Variable, probe: dict[str, list], names: NodeNames) -> None:
    """Make every Reshape/Expand from the cache concat to the attention MatMul length-agnostic."""
    frontier = list(full.outputs)
    while frontier:
        node = frontier.pop()
        if node.op == "MatMul" or node.op not in _LAYOUT | {"Mul", "Div"}:
            continue
        out = probe.get(node.outputs[0].name)
        if node.op in ("Reshape", "Expand") and out is not None and all(isinstance(d, int) for d in out):
            if out.count(PROBE_SEQ) != 1:
                raise InputError(f"{node.name}: cannot tell the sequence axis of its output shape {out}")
            dims = [(-1 if node.op == "Reshape" else 1) if d == PROBE_SEQ else d for d in out]
            node.inputs[1] = gs.Constant(names.new(f"{node.name}/kv_shape"), np.array(dims, np.int64))
            node.attrs.pop("allowzero", None)
        frontier += node.outputs[0].outputs


def _find(tensor: gs.Tensor, through: set[str], up: bool, depth: int = 6) -> gs.Node | None:
    """The nearest MatMul upstream (`up`) of / downstream of `tensor`, via `through` ops only."""
    frontier = [tensor]
    for _ in range(depth):
        nxt = []
        for t in frontier:
            for node in t.inputs if up else t.outputs:
                if node.op == "MatMul" and (up or node.inputs[0] is t):
                    return node
                if node.op in through:
                    nxt += [x for x in node.inputs if isinstance(x, gs.Variable)] if up else list(node.outputs)
        frontier = nxt
    return None


def _kv_entry(tensor: gs.Tensor) -> gs.Variable:
    for _ in range(16):
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or (node.op == "Transpose" and list(node.attrs.get("perm", [])) == [0, 2, 1, 3]):
            return tensor
        if node.op in _LAYOUT:
            tensor = node.inputs[0]
        elif node.op in ("Mul", "Div") and _scalar(node.inputs[1]):
            tensor = node.inputs[0]
        elif node.op == "Mul" and _scalar(node.inputs[0]):
            tensor = node.inputs[1]
        else:
            return tensor
    return tensor


def _fused_entry(entry: gs.Tensor) -> str:
    """Why a K/V entry is not per-head: a contrib op (e.g. com.microsoft RotaryEmbedding) makes it
    on packed [B, S, Hkv*D] K/V, so there is no [B, Hkv, S, D] tensor to cut ('' otherwise)."""
    node = entry.inputs[0] if entry.inputs else None
    if node is None or node.domain in ("", "ai.onnx"):
        return ""
    return (f" (made by fused op {node.domain} {node.op} '{node.name}' on packed [B, S, Hkv*D] K/V: "
            "export with cache I/O, or without ORT fusions)")


def _scalar(tensor: gs.Tensor) -> bool:
    """A constant or a one-element tensor (a scale such as 1/sqrt(sqrt(D)))."""
    return isinstance(tensor, gs.Constant) or (tensor.shape is not None and all(d == 1 for d in tensor.shape))


def _position_input(graph: gs.Graph, names: NodeNames, probe: dict[str, list]) -> None:
    """Feed cos/sin from a `position_ids [batch, seq]` input instead of Range(0, seq).

    Only the rotary-only region (nodes whose every use leads to Cos/Sin) is rewired: the mask
    construction that shares the Range keeps it, so the mask pass still sees a mask-only subgraph.
    """
    if any(t.name == "position_ids" for t in graph.inputs):
        return
    trig = [n for n in graph.nodes if n.op in ("Cos", "Sin")]
    ancestors, stack = set(), list(trig)
    while stack:
        node = stack.pop()
        if id(node) not in ancestors:
            ancestors.add(id(node))
            stack += [t.inputs[0] for t in node.inputs if t.inputs]
    chain, stack = set(), [n for n in graph.nodes if n.op == "Range" and id(n) in ancestors]
    while stack:
        node = stack.pop()
        if id(node) not in chain and id(node) in ancestors:
            chain.add(id(node))
            stack += [c for t in node.outputs for c in t.outputs]
    if not chain:
        return
    rotary = {id(n) for n in trig}
    for node in reversed(graph.nodes):
        if id(node) in ancestors and node.op != "Range" and all(id(c) in rotary for t in node.outputs for c in t.outputs):
            rotary.add(id(node))
    positions = gs.Variable("position_ids", np.int64, ["batch_size", "sequence_length"])
    flat = None
    for node in graph.nodes:
        if id(node) not in rotary:
            continue
        for j, t in enumerate(node.inputs):
            if not t.inputs or id(t.inputs[0]) not in chain or id(t.inputs[0]) in rotary:
                continue
            rank = len(probe.get(t.name) or [])
            if rank == 2:
                node.inputs[j] = positions
            elif rank == 1:
                if flat is None:
                    flat = gs.Variable(names.new("kv_cache/positions"), np.int64, None)
                    graph.nodes.append(gs.Node("Squeeze", names.new("kv_cache/positions_squeeze"), inputs=[
                        positions, gs.Constant(names.new("kv_cache/axes0"), np.array([0], np.int64))], outputs=[flat]))
                node.inputs[j] = flat
            else:
                raise InputError(f"RoPE positions '{t.name}' have rank {rank}; expected [seq] or [batch, seq]")
            if t.dtype is not None and np.dtype(t.dtype) != np.int64:
                raise InputError(f"RoPE positions '{t.name}' are {np.dtype(t.dtype)}, expected int64")
    for node in list(flat.outputs) if flat is not None else []:  # Unsqueeze(flat, [0, ...]): use positions
        axes = node.attrs.get("axes") if len(node.inputs) < 2 else values_of(node.inputs[1])
        if node.op != "Unsqueeze" or axes is None:
            continue
        rank = 1 + np.size(axes)
        axes = sorted(int(a) % rank for a in np.reshape(axes, -1))
        if axes[0] != 0:
            continue
        if len(axes) == 1:
            out = node.outputs[0]
            for user in list(out.outputs):
                for j, x in enumerate(user.inputs):
                    if x is out:
                        user.inputs[j] = positions
        else:  # cleanup would merge Squeeze + Unsqueeze into a Reshape fixed to T (no RoPE table then)
            node.inputs[0] = positions
            if len(node.inputs) < 2:
                node.attrs["axes"] = axes[1:]
            else:
                node.inputs[1] = gs.Constant(names.new("kv_cache/axes"), np.array(axes[1:], np.int64))
    if positions.outputs:
        graph.inputs.append(positions)


# ---------------------------------------------------------------------------- kv-cache-io


def layer_caches(graph: gs.Graph) -> list[LayerCache]:
    """The per-layer cache concats of a graph already through `kv-cache` (inputs past_<kv>_<i>)."""
    pasts = {k: v for k, v in past_inputs(graph).items()}
    layers: dict[int, LayerCache] = {}
    for (i, kind), past in sorted(pasts.items()):
        concat = cache_concat(past)
        if concat is None:
            raise InputError(f"cache input '{past.name}': no Concat(past, new, axis=2) consumes it")
        layer = layers.setdefault(i, LayerCache(i, {}, {}))
        layer.past[kind], layer.concat[kind] = past, concat
    return [layers[i] for i in sorted(layers)]


@register
class KvCacheIo(Pass):
    name = "kv-cache-io"
    description = "present_* outputs: new entries [1,Hkv,T,D] (cache_io=new) or the slid cache [1,Hkv,C,D]"
    changes_io = True  # also drops inputs that became unused and puts the I/O in contract order

    def applies(self, ctx: Context) -> bool:
        return _kv_on(ctx)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        t, c, mode = _opts(ctx)
        outputs = {o.name: o for o in graph.outputs}
        names = NodeNames(graph)
        rewrites = 0
        for layer in layer_caches(graph):
            for kind in KINDS:
                name = f"present_{kind}_{layer.index}"
                concat = layer.concat[kind]
                full = concat.outputs[0]
                _, hkv, _, d = layer.past[kind].shape
                if outputs.get(name) is not full:
                    continue  # already rewritten, or a chunk without this layer
                full.name = f"kv_{kind}_{layer.index}"
                if mode == "new":
                    present = concat.inputs[1]
                    if present in graph.inputs or isinstance(present, gs.Constant):
                        raise InputError(f"{full.name}: the new {kind} entries are not computed by the graph")
                else:
                    present = gs.Variable(name, np.float32, [1, hkv, c, d])
                    graph.nodes.append(gs.Node(
                        "Slice", names.new(f"kv_cache/slide_{kind}_{layer.index}"),
                        inputs=[full] + [gs.Constant(names.new(f"kv_cache/{n}_{kind}_{layer.index}"),
                                                     np.array([v], np.int32))
                                         for n, v in (("start", t), ("end", t + c), ("axis", 2))],
                        outputs=[present]))
                present.name = name
                present.dtype = np.float32
                present.shape = [1, hkv, t if mode == "new" else c, d]
                graph.outputs[graph.outputs.index(outputs[name])] = present
                rewrites += 1
        graph.cleanup(remove_unused_graph_inputs=True)  # e.g. new_token_mask once its Shape folded
        contract_order(graph)
        return PassResult(rewrites=rewrites)

    def map_outputs(self, outputs, ctx):
        t, c, mode = _opts(ctx)
        mapped = {}
        for name, value in outputs.items():
            if name.startswith("present_"):
                value = layouts.from_outputs(value, mode, t, c)
            mapped[name] = value
        return mapped


# ---------------------------------------------------------------------------- layer-chunks


@register
class LayerChunks(Pass):
    name = "layer-chunks"
    description = "keep chunk k of N equal decoder-layer ranges; hidden_states in / hidden_states_out out"
    idempotent = False

    def applies(self, ctx: Context) -> bool:
        return _kv_on(ctx) and (ctx.options.chunks or 1) > 1

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        n, k = ctx.options.chunks or 1, ctx.options.chunk or 0
        layers = layer_caches(graph)
        if not layers or len(layers) % n:
            raise InputError(f"--chunks {n} does not divide the model's {len(layers)} decoder layers evenly")
        if not 0 <= k < n:
            raise InputError(f"chunk {k} out of range for --chunks {n}")
        per = len(layers) // n
        first, last = k * per, (k + 1) * per
        bounds = layer_boundaries(graph, layers)
        keep = {f"present_{kind}_{i}" for i in range(first, last) for kind in KINDS}
        outputs = [o for o in graph.outputs if o.name in keep]
        if last < len(layers):
            out = bounds[last]
            out.name = "hidden_states_out"
            out.dtype, out.shape = out.dtype or np.float32, _hidden_shape(out, ctx)
            outputs.insert(0, out)
        else:
            outputs.insert(0, next(o for o in graph.outputs if o.name == "logits"))
        self.kept = {o.name for o in outputs}
        self.prefix = None
        if first > 0 and ctx.options.verify_each:  # map_feeds computes hidden_states with it
            self.prefix = graph.copy()
            self.prefix.outputs = [self.prefix.tensors()[bounds[first].name]]
            self.prefix.cleanup(remove_unused_graph_inputs=True)
        if first > 0:
            cut = bounds[first]
            for x in graph.inputs:
                if x.name == "hidden_states":  # chunk 0's input (host embedding): dead here
                    x.name = "hidden_states/embedded"
            hidden = gs.Variable("hidden_states", cut.dtype or np.float32, _hidden_shape(cut, ctx))
            for node in list(cut.outputs):
                for j, x in enumerate(node.inputs):
                    if x is cut:
                        node.inputs[j] = hidden
            graph.inputs = [hidden] + [x for x in graph.inputs if x.name != "hidden_states/embedded"]
        graph.outputs = outputs
        graph.cleanup(remove_unused_graph_inputs=True)
        contract_order(graph)
        return PassResult(rewrites=1, notes=[f"chunk {k}/{n}: layers {first}..{last - 1}"])

    def map_feeds(self, feeds, ctx):
        if self.prefix is None:
            return feeds
        from mtkc.ir.execute import run

        hidden = next(iter(run(self.prefix, {t.name: feeds[t.name] for t in self.prefix.inputs}, ctx.root).values()))
        return {**feeds, "hidden_states": hidden}

    def map_outputs(self, outputs, ctx):
        return {k: v for k, v in outputs.items() if k in self.kept}


def _hidden_shape(tensor: gs.Tensor, ctx: Context):
    """[1, T, H]: the residual stream's bound shape (a fused op's output may keep export symbols)."""
    shape = tensor.shape
    if shape is None or len(shape) != 3:
        return shape
    return [1, ctx.options.seq_len or shape[1], shape[2]]


def contract_order(graph: gs.Graph) -> None:
    """Graph I/O in contract order: tokens/hidden, mask, positions, then per layer key, value."""
    graph.inputs = sorted(graph.inputs, key=lambda t: io.order_key(t.name))
    graph.outputs = sorted(graph.outputs, key=lambda t: io.order_key(t.name))


def layer_boundaries(graph: gs.Graph, layers: list[LayerCache]) -> dict[int, gs.Variable]:
    """Residual-stream tensor entering layer i, for every layer i (from the dominator tree)."""
    sources = [x for x in graph.inputs if x.name in ("input_ids", "hidden_states")]
    logits = next((o for o in graph.outputs if o.name == "logits"), None)
    if not sources or logits is None or not logits.inputs:
        raise InputError("layer chunks need a token input (input_ids or hidden_states) and a logits output")
    dag = nx.DiGraph()
    src, sink = "<src>", "<sink>"
    for node in graph.nodes:
        for out in node.outputs:
            for user in out.outputs:
                if user.op not in ("Shape", "Size"):
                    dag.add_edge(id(node), id(user))
    for node in sources[0].outputs:
        dag.add_edge(src, id(node))
    dag.add_edge(id(logits.inputs[0]), sink)
    idom = nx.immediate_dominators(dag, src)
    if sink not in idom:
        raise InputError("logits are not computed from the token input")
    chain, x = [], sink
    while x != src:
        x = idom[x]
        chain.append(x)
    on_chain = set(chain)
    by_id = {id(node): node for node in graph.nodes}
    bounds = {}
    for layer in layers:
        x = id(layer.concat["key"])
        if x not in idom:
            raise InputError(f"layer {layer.index}: its cache concat does not depend on the token input")
        while x not in on_chain:
            x = idom[x]
        if x == src:
            bounds[layer.index] = sources[0]
            continue
        node = by_id[x]
        if len(node.outputs) != 1:
            raise InputError(f"layer {layer.index}: boundary node '{node.name}' has {len(node.outputs)} outputs")
        bounds[layer.index] = node.outputs[0]
    return bounds
