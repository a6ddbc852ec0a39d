"""The additive attention mask: its value and its one builder.

A compiled graph takes `attention_mask` float [1,1,T,C+T]: 0 where query row i may see key
column j, `value` where it may not, added to the attention scores before Softmax. Key columns
are the C cache slots, then the T new tokens (bottom-right aligned, so query i is the token at
column C+i). Row i sees column j iff j <= C+i (causal) and the key holds a real token (`keys`).
Sliding-window layers (Mistral, Gemma 2/3 local layers) take `attention_mask_window_<W>`: the
same, and the key is one of the last W positions (query position - key position < W; positions
count the real tokens: cache slots hold them in order, whatever the layout's gaps).

Default value: softmax weight of a masked key is exp(score + value - max); the value must
outweigh every score difference a model produces, or masked (empty or padded) keys leak in and
change the tokens. -100 (MediaTek's runtime) is not enough for models whose scores exceed ~100
(large q/k norms or biases: unusual, but real). -3e4 is the most negative round value with fp16
headroom: score + value stays finite in fp16 (|.| < 65504) for any |score| < 3.5e4, and
exp(-3e4) is 0 in every float format. `--mask-value` overrides it (to match a runtime);
`mtkc verify` fails when a chosen value changes the tokens.
"""

from __future__ import annotations

import numpy as np

DEFAULT_VALUE = -3.0e4


def value_of(options) -> float:
    """The mask value a compile uses: option `mask_value` (typed Options or a manifest's dict), else the default."""
    given = options.get("mask_value") if isinstance(options, dict) else getattr(options, "mask_value", None)
    return DEFAULT_VALUE if given is None else float(given)


def additive(seq: int, total: int, value: float = DEFAULT_VALUE, keys=None, dtype=np.float32,
             offset: int | None = None, window: int | None = None) -> np.ndarray:
    """[seq, total] additive causal mask: row i sees column j iff j <= offset+i and `keys[j]`
    (bool [total], default all real); offset: the columns before row 0's token (default total-seq);
    `window`: and offset+i - j < window (columns are consecutive positions)."""
    return np.where(_allowed(seq, total, keys, offset, window), 0.0, value).astype(dtype)


def _allowed(seq: int, total: int, keys=None, offset: int | None = None, window: int | None = None) -> np.ndarray:
    offset = total - seq if offset is None else offset
    distance = offset + np.arange(seq)[:, None] - np.arange(total)[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    if keys is not None:
        allowed &= np.asarray(keys, bool).reshape(total)[None, :]
    return allowed


def attention_mask(seq: int, cache: int, value: float = DEFAULT_VALUE, cached=None, new=None,
                   dtype=np.float32, window: int | None = None) -> np.ndarray:
    """The graph input [1,1,T,C+T]: `cached` bool [C] says which cache slots hold a token (default
    none), `new` bool [T] which of the T new rows are real (default all; padding after them);
    `window`: a sliding-window layer's mask (the cached tokens are positions 0.. in slot order)."""
    slots = np.zeros(cache, bool) if cached is None else np.asarray(cached, bool)
    rows = np.ones(seq, bool) if new is None else np.asarray(new, bool)
    keys = np.concatenate([slots, rows])
    allowed = _allowed(seq, cache + seq, keys)
    if window is not None:
        filled = int(slots.sum())
        where = np.concatenate([np.cumsum(slots) - 1, filled + np.arange(seq)])  # each column's position
        allowed &= (filled + np.arange(seq))[:, None] - where[None, :] < window
    return np.where(allowed, 0.0, value).astype(dtype)[None, None]


def with_empty_cache(mask: np.ndarray, cache: int, value: float = DEFAULT_VALUE) -> np.ndarray:
    """[..., T, T] mask of T new tokens -> [..., T, C+T]: the C cache slots first, all empty (masked)."""
    mask = np.asarray(mask)
    return np.concatenate([np.full(mask.shape[:-1] + (cache,), value, mask.dtype), mask], axis=-1)
