"""What `verify --quant` measures, quantised vs float, at real positions only.

    Agreement    running cosine, SQNR (dB), max abs error, top-1 over the rows given
    real_rows    the query rows of a call that hold a token: row i sees its own column C+i
    forced       logits of a pipeline on its own cache, fed a given token sequence (prefill calls
                 over the prompt, then one decode call per continuation token)
    perplexity   exp(mean next-token NLL) over held-out ids, windows of the cache length
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtkc.contract import io
from mtkc.errors import InputError


@dataclass
class Agreement:
    """Running comparison of one tensor, quantised vs float, over every call."""

    dot: float = 0.0
    norm_q: float = 0.0
    norm_f: float = 0.0
    err: float = 0.0
    max_abs: float = 0.0
    worst: float = 1.0  # lowest cosine of a single call
    top1: int = 0
    rows: int = 0

    def add(self, quant: np.ndarray, ref: np.ndarray, top1: bool = False) -> None:
        """`quant`, `ref`: [rows, features] (or anything, flattened); `top1`: count argmax agreement per row."""
        q, f = np.asarray(quant, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
        if not q.size:
            return
        self.dot += float(q @ f)
        self.norm_q += float(q @ q)
        self.norm_f += float(f @ f)
        self.err += float((q - f) @ (q - f))
        self.max_abs = max(self.max_abs, float(np.abs(q - f).max()))
        self.worst = min(self.worst, cosine(float(q @ f), float(q @ q), float(f @ f)))
        if top1:
            a, b = np.asarray(quant), np.asarray(ref)
            a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            self.top1 += int((a.argmax(-1) == b.argmax(-1)).sum())
            self.rows += a.shape[0]

    @property
    def cosine(self) -> float:
        return cosine(self.dot, self.norm_q, self.norm_f)

    @property
    def sqnr_db(self) -> float:
        """10 log10(signal / quantisation noise); capped at 200 dB for identical tensors."""
        if self.err == 0:
            return 200.0
        return float(min(200.0, 10 * np.log10(self.norm_f / self.err))) if self.norm_f else 0.0

    def figures(self) -> dict:
        out = {"cosine": self.cosine, "sqnr_db": self.sqnr_db, "worst_call_cosine": self.worst, "max_abs": self.max_abs}
        return {**out, "top1": self.top1 / self.rows, "positions": self.rows} if self.rows else out


def cosine(dot: float, nq: float, nf: float) -> float:
    if nq == 0 and nf == 0:
        return 1.0
    return dot / np.sqrt(nq * nf) if nq and nf else 0.0


def real_rows(feed: dict, tokens: int) -> np.ndarray:
    """bool [T]: the query rows holding a token, read off the additive mask's diagonal (a padded row
    cannot see its own column C+i); all rows when the graph takes no additive mask."""
    mask = feed.get(io.ATTENTION_MASK)
    if mask is None or np.ndim(mask) != 4 or mask.shape[-2] != tokens:
        return np.ones(tokens, bool)
    m = np.asarray(mask)[0, 0]
    width = m.shape[-1]
    return m[np.arange(tokens), width - tokens + np.arange(tokens)] == 0


def rows_of(value: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The real rows of a [1, T, ...] output (axis 1 of length T), else the value unchanged."""
    value = np.asarray(value)
    if value.ndim >= 2 and value.shape[1] == len(rows):
        return value[:, rows]
    return value


def forced(generator, prompt: list[int], continuation: list[int] = ()) -> np.ndarray:
    """Logits [len(prompt) + len(continuation), V] of `generator` on its own cache: the prompt in
    prefill calls of T tokens, then each continuation token in a decode call (as greedy decoding
    would feed them)."""
    generator.reset()
    t = generator.prefill[0].tokens
    rows = []
    for start in range(0, len(prompt), t):
        chunk = prompt[start:start + t]
        if not generator.fits(t, len(chunk)):
            raise InputError(f"sequence of {len(prompt)} tokens does not fit the cache of {generator.cache_len}")
        rows.append(generator.step(generator.prefill, chunk))
    for token in continuation:
        if not generator.fits(1, 1):
            break
        rows.append(generator.step(generator.decode, [int(token)]))
    return np.concatenate(rows)


def windows(ids: list[int], generator, limit: int) -> list[list[int]]:
    """At most `limit` ids cut into windows that fill the cache in whole prefill calls."""
    t = generator.prefill[0].tokens
    width = max(t, generator.cache_len // t * t)
    ids = list(ids)[:limit]
    return [ids[k:k + width] for k in range(0, len(ids), width) if len(ids[k:k + width]) > 1]


def nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood of ids[1:] given the rows before, count)."""
    x = np.asarray(logits[:-1], np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    target = np.asarray(ids[1:len(x) + 1])
    return float(-logp[np.arange(len(target)), target].sum()), len(target)
