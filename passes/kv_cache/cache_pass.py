"""`kv-cache`: name the cache I/O of a decoder export, or insert one.

    <cache input> ──► [Identity | Concat(1 input)]* ──► Concat(axis=2) ◄── K after RoPE
    (found by structure: see `detect`)                      │
                                                            ▼
                                              <present output> ─► attention
  ->  inputs  past_key_<i> / past_value_<i> [1,Hkv,C,D] (Hkv, D bound here from the new entries'
      shape, whatever the exporter called them; batch and C by `bind-shapes`)
      outputs logits [1,T,V], present_key_<i> / present_value_<i> = the concat [1,Hkv,C+T,D].
An export whose attention reads no mask input (transformers' generation export builds a causal
mask from shapes alone, so every zero-filled static cache slot would be attended) gets the
standard additive `attention_mask` [1,1,T,C+T] input (`mask.implicit_mask`).
Without cache I/O, `insert.insert_cache` splices the cache in.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.contract import io
from mtkc.contract import mask as contract_mask
from mtkc.errors import InputError
from mtkc.analysis.cache import KINDS, LayerCache, cache_head_dims, find_caches, layer_pasts, probe_shapes
from mtkc.ir.graph_utils import Names as NodeNames
from mtkc.passes.kv_cache.insert import insert_cache, position_input
from mtkc.passes.kv_cache.plan import DEFAULT_CACHE_LEN, kv_on
from mtkc.passes.mask import additive_shape, implicit_mask
from mtkc.rewrite.pass_api import Context, Pass, PassResult, register


@register
class KvCache(Pass):
    name = "kv-cache"
    description = "name the KV-cache I/O (past_key_<i> [1,Hkv,C,D], present_*), insert it in no-cache exports"

    def applies(self, ctx: Context) -> bool:
        return kv_on(ctx.options)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:

        dm = ctx.analysis(decoder_map, graph)
        layers = find_caches(graph, dm)
        notes = []
        self.inserted: dict[str, list] = {}  # no-cache export: new past inputs -> [Hkv, D]
        self.implicit = None
        self.positions = False  # a position_ids input made for the RoPE of a cache export without one
        if layers:
            _bind_head_dims(graph, layers, ctx)
            self.implicit = implicit_mask(graph, ctx)
            if self.implicit is not None:
                notes.append(f"no mask input: the mask built from shapes alone became input '{self.implicit.name}'")
            if not any(t.name == "position_ids" for t in graph.inputs):
                position_input(graph, NodeNames(graph), probe_shapes(graph, ctx.root)[0])
                self.positions = any(t.name == "position_ids" for t in graph.inputs)
                if self.positions:
                    notes.append("no position input: RoPE's positions, counted from the past's length (fixed at "
                                 "--cache-len in a static cache), became input 'position_ids'")
        else:
            _require_mask_early(graph)
            layers = insert_cache(graph, dm, ctx.root)
            notes.append(f"no cache I/O in the export: inserted past concat in {len(layers)} attention layers")
            self.inserted = {l.past[k].name: [l.past[k].shape[1], l.past[k].shape[3]] for l in layers for k in KINDS}
            for t in graph.inputs:  # mask-early's [1,1,T,T] (per window): the cache slots come first
                if io.is_mask(t.name):
                    t.shape = additive_shape(graph, ctx)
        self.renames = _name_io(graph, layers)
        ctx.renamed.update({new: old for old, new in self.renames.items()})
        rewrites = len(self.renames) + (self.implicit is not None) if not self.inserted else len(layers)
        return PassResult(rewrites=rewrites, notes=notes)

    def map_feeds(self, feeds, ctx):
        """Renamed cache inputs; a no-cache export gets an empty cache (all slots masked in
        mask-early's additive mask) and positions 0..T-1."""
        feeds = {self.renames.get(k, k): v for k, v in feeds.items()}
        if self.positions:  # what the export counted: past length + 0..S-1
            ids = next(v for k, v in feeds.items() if k in ("input_ids", "hidden_states"))
            past = next(np.shape(v)[2] for k, v in feeds.items() if k.startswith("past_"))
            feeds["position_ids"] = np.arange(past, past + ids.shape[1], dtype=np.int64)[None]
        if self.implicit is not None:
            feeds = self.implicit.map_feeds(feeds, ctx)
        if not self.inserted:
            return feeds
        ids = next(v for k, v in feeds.items() if k in ("input_ids", "hidden_states"))
        t, c = ids.shape[1], ctx.options.cache_len or DEFAULT_CACHE_LEN
        for name in [k for k in feeds if io.is_mask(k)]:
            feeds[name] = contract_mask.with_empty_cache(feeds[name], c, contract_mask.value_of(ctx.options))
        feeds["position_ids"] = np.arange(t, dtype=np.int64)[None]
        for name, (hkv, d) in self.inserted.items():
            feeds[name] = np.zeros((1, hkv, c, d), np.float32)
        return feeds

    def map_outputs(self, outputs, ctx):
        return {self.renames.get(k, k): v for k, v in outputs.items()}


def _bind_head_dims(graph: gs.Graph, layers: list[LayerCache], ctx: Context) -> None:
    """Cache input axes 1 and 3 (kv heads, head dim), when the export left them symbolic."""
    pasts = [p for layer in layers for p in layer.past.values()]
    if all(p.shape is not None and len(p.shape) == 4 and all(isinstance(p.shape[a], int) for a in (1, 3)) for p in pasts):
        return  # static already (TorchScript): no probe of the whole graph
    dims = cache_head_dims(graph, layer_pasts(layers), ctx.root)
    for layer in layers:
        for past in layer.past.values():
            if past.shape is not None and past.name in dims:
                past.shape = [dims[past.name][a // 2] if a in (1, 3) and not isinstance(d, int) else d
                              for a, d in enumerate(past.shape)]


def _name_io(graph: gs.Graph, layers: list[LayerCache]) -> dict[str, str]:
    """Contract names for the cache I/O and outputs in contract order; returns {old: new name}.

    The logits are the one output that is not a cache: named `logits` whatever the exporter called it.
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
    cached = {id(p) for p in presents}
    rest = [o for o in graph.outputs if id(o) not in cached]
    logits = next((o for o in rest if o.name == "logits"), rest[0] if rest else None)
    if logits is not None:
        rename(logits, "logits")
    graph.outputs = ([logits] if logits is not None else []) + presents
    return renames


def _require_mask_early(graph: gs.Graph) -> None:
    """The [B,1,T,T] mask construction breaks once the cache is spliced in: `mask-early` must have
    replaced it (it leaves no 2-D `attention_mask` input)."""
    if any(t.name == io.ATTENTION_MASK and t.shape is not None and len(t.shape) == 2 for t in graph.inputs):
        raise InputError("kv-cache: an export without cache I/O needs the mask-early pass before kv-cache "
                         "(its 2-D attention_mask is still an input): add mask-early to --passes")
