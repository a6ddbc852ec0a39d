"""Variant planning: which graphs a compile produces, and how layers split into chunks.

    model                       a model without KV cache (kv_cache False, or None and no cache found)
    prefill, decode             seq_len T (default 128) / 1, both cache_len C (default 512)
    prefill_<k>, decode_<k>     with chunks N > 1, k = 0..N-1 (layers split as evenly as possible)
Overrides per variant: kv_cache, variant, seq_len, cache_len, cache_io, chunks, chunk,
max_positions (C + T for both, so RoPE tables are the same constant).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap, decoder_map
from mtkc.contract import cache as layouts
from mtkc.display import escape
from mtkc.errors import InputError

DEFAULT_SEQ_LEN = layouts.DEFAULT_SEQ_LEN
DEFAULT_CACHE_LEN = layouts.DEFAULT_CACHE_LEN
CACHE_IO = layouts.LAYOUTS


@dataclass(frozen=True)
class Variant:
    """One graph a compile produces: its manifest name and the option overrides of its run."""

    name: str
    options: dict = field(default_factory=dict)


def chunk_ranges(layers: int, chunks: int) -> list[range]:
    """`chunks` consecutive layer ranges as even as possible, the larger first (28 in 3: 10/9/9)."""
    if not 1 <= chunks <= layers:
        raise InputError(f"--chunks {chunks}: expected 1..{layers} (the model has {layers} decoder layers)")
    per, extra = divmod(layers, chunks)
    bounds = [0]
    for k in range(chunks):
        bounds.append(bounds[-1] + per + (1 if k < extra else 0))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def variants(graph: gs.Graph, options: dict, dm: DecoderMap | None = None) -> list[Variant]:
    """The graphs to produce: `model`, or prefill/decode (per chunk) for a KV-cache decoder.

    Layers and "has a cache" are the DecoderMap's (`mtkc.analysis.decoder`): a refused candidate
    is no layer; a layer whose k/v path reads a past input has a cache. `dm`: the graph's map, when known."""
    kv, dm = options.kv_cache, dm or decoder_map(graph)
    if kv is not False:  # --no-kv-cache: the cache inputs stay inputs, as asked
        _refuse_unrecognised_cache(dm)
    if kv is None:
        kv = dm.cached
    if not kv:
        return [Variant("model", {})]
    seq_len = options.seq_len or DEFAULT_SEQ_LEN
    cache_len = options.cache_len or DEFAULT_CACHE_LEN
    cache_io = options.cache_io or "new"
    chunks = 1 if options.chunks is None else options.chunks
    if cache_io not in CACHE_IO:
        raise InputError(f"--cache-io {cache_io}: expected one of {', '.join(CACHE_IO)}")
    if seq_len < 1 or cache_len < 1:
        raise InputError(f"--seq-len/--cache-len must be >= 1 (got {seq_len}/{cache_len})")
    layers = len(dm.layers)
    if layers or chunks != 1:
        chunk_ranges(layers, chunks)
    max_pos = options.max_positions or seq_len + cache_len  # one RoPE table for both graphs
    out = []
    for variant, t in (("prefill", seq_len), ("decode", 1)):
        for k in range(chunks):
            name = variant if chunks == 1 else f"{variant}_{k}"
            out.append(Variant(name, {"kv_cache": True, "variant": variant, "seq_len": t, "cache_len": cache_len,
                                      "cache_io": cache_io, "chunks": chunks, "chunk": k, "max_positions": max_pos}))
    return out


def _refuse_unrecognised_cache(dm: DecoderMap) -> None:
    """An attention that reads a cache input but is no layer the DecoderMap recognises would leave
    that cache as a plain input of one static graph: refused, naming the attention and why. (Before
    the cache is looked for: a cache inside a fused op has no Concat for `find_caches` to refuse, and
    without a recognised cache the plan is one `model` graph and `kv-cache` never runs.)"""
    refused = next((x for x in dm.refused if x.past), None)
    if refused is None:
        return
    raise InputError(f"layer {refused.index} (attention '{escape(refused.anchor)}') reads cache input "
                     f"'{escape(next(iter(refused.past.values())))}' but is not a decoder layer mtkc recognises: "
                     f"{escape(refused.refused)}")


def kv_on(options: dict) -> bool:
    return bool(options.kv_cache)


def cache_options(options: dict) -> tuple[int, int, str]:
    """(T, C, cache_io) of a variant run."""
    t = options.seq_len or DEFAULT_SEQ_LEN
    c = options.cache_len or DEFAULT_CACHE_LEN
    return t, c, options.cache_io or "new"
