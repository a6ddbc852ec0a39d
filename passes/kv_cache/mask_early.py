"""`mask-early`: the mask pass, run before `kv-cache` inserts a cache into a no-cache export.

An export without cache I/O builds its [B,1,T,T] mask from the sequence length; once the past
concat is spliced in, that construction no longer matches the [T, C+T] scores. So on such an
export the mask is replaced first, while the construction is still consistent:

    2-D attention_mask ─► (causal + padding mask construction) ─► Add ─ Softmax
  ->  attention_mask float [1,1,T,T] ─► Add ─ Softmax    (`kv-cache` widens it to [1,1,T,C+T])

An export with no mask input whose mask is built from shapes alone gets the same input
(`mask.implicit_mask`). A 2-D mask the export still reads (e.g. for its shape, when there is no
input_ids to read it from) stays, renamed `new_token_mask` [1, T] so that shape binding keeps it at T.
Does nothing on an export with cache I/O: the `mask` pass handles those in its place.
"""

from __future__ import annotations

from dataclasses import replace

import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.contract import io
from mtkc.analysis.cache import find_caches
from mtkc.passes.kv_cache.plan import DEFAULT_CACHE_LEN, DEFAULT_SEQ_LEN, kv_on
from mtkc.passes.mask import Mask, implicit_mask
from mtkc.rewrite.pass_api import Context, PassResult, register

NEW_TOKEN_MASK = "new_token_mask"


@register
class MaskEarly(Mask):
    name = "mask-early"
    description = "no-cache export, kv-cache on: the mask pass before the cache is inserted (additive [1,1,T,T])"

    def applies(self, ctx: Context) -> bool:
        return kv_on(ctx.options)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        self.implicit, self.kept = None, None
        if find_caches(graph, ctx.analysis(decoder_map, graph)):
            return PassResult(notes=["the export has cache I/O: the mask pass runs in its place"])
        early = replace(ctx, options=replace(ctx.options, kv_cache=False, cache_len=None))  # no cache yet: [T, T]
        self.span = (ctx.options.seq_len or DEFAULT_SEQ_LEN) + (ctx.options.cache_len or DEFAULT_CACHE_LEN)  # windows
        result = super().run(graph, early)
        self.implicit = implicit_mask(graph, early, self.span)
        if self.implicit is not None:
            result.rewrites += 1
            result.notes.append(f"no mask input: the mask built from shapes alone became input '{self.implicit.name}'")
        old = next((t for t in graph.inputs if t.name == io.ATTENTION_MASK and t.shape is not None
                    and len(t.shape) == 2), None)
        if old is not None:
            ids = next((t for t in graph.inputs if t.name in ("input_ids", "hidden_states")), None)
            self.kept, old.name = old.name, NEW_TOKEN_MASK
            old.shape = [1, ids.shape[1] if ids is not None and ids.shape else "sequence_length"]
        return result

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """The 2-D mask -> the additive [1,1,T,T] mask (or the shapes-only mask's), and
        `new_token_mask` when the 2-D input stays."""
        if self.kept is not None and self.kept in feeds:
            feeds = {**feeds, NEW_TOKEN_MASK: feeds[self.kept]}
        feeds = super().map_feeds(feeds, ctx)
        if self.implicit is not None:
            feeds = self.implicit.map_feeds(feeds, ctx)
        if self.kept is not None:
            feeds.pop(self.kept, None)
        return feeds
