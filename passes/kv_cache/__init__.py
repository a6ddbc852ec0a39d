"""KV cache: a decoder export -> static prefill / decode graphs over a fixed-size cache.

How compile uses this package (`mtkc.pipeline.compile`): `variants(graph, options)` plans the
graphs (`plan`), and the pipeline runs once per variant on a fresh load, all graphs through one
WeightWriter. Pipeline order: `mask-early` and `kv-cache` first (before bind-shapes: a no-cache export still
computes its shapes with Shape ops, so an inserted past concat propagates), `kv-cache-io` and
`layer-chunks` last. The cache contract is that of MediaTek's LLM runtime (ExecuTorch mediatek/).

    (detect)    the cache found by structure in the DecoderMap's layers: `mtkc.analysis.cache`
                (find_caches, layer_caches after naming, cache_head_dims), which bind-shapes reads too
    mask_early  `mask-early`: a no-cache export's mask replaced before the cache goes in
    insert      splicing a cache into an export without one
    cache_pass  `kv-cache`: contract names, bound head dims, the additive mask of mask-less exports
    io          `kv-cache-io`: new-entries-only or sliding present outputs; contract I/O order
    chunks      `layer-chunks`: one of N near-equal layer ranges per graph
    plan        the variants (prefill/decode per chunk) and the chunk ranges
"""

from mtkc.analysis.cache import KINDS, LayerCache, cache_concat, cache_head_dims, find_caches, layer_caches
from mtkc.passes.kv_cache.cache_pass import KvCache
from mtkc.passes.kv_cache.chunks import LayerChunks
from mtkc.passes.kv_cache.insert import insert_cache
from mtkc.passes.kv_cache.mask_early import NEW_TOKEN_MASK, MaskEarly
from mtkc.passes.kv_cache.io import KvCacheIo, contract_order
from mtkc.passes.kv_cache.plan import CACHE_IO, DEFAULT_CACHE_LEN, DEFAULT_SEQ_LEN, Variant, chunk_ranges, variants

__all__ = ["CACHE_IO", "DEFAULT_CACHE_LEN", "DEFAULT_SEQ_LEN", "KINDS", "NEW_TOKEN_MASK", "KvCache", "KvCacheIo",
           "LayerCache", "LayerChunks", "MaskEarly", "Variant", "cache_concat", "cache_head_dims", "chunk_ranges", "contract_order",
           "find_caches", "insert_cache", "layer_caches", "variants"]
