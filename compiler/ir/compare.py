"""Numeric agreement of two arrays: the one comparison verify and --verify-each share."""

from __future__ import annotations

import numpy as np


def compare(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[float, float, float, bool]:
    """(max abs, max rel, cosine, close). Rel error is taken where |expected| > atol (no 0/0 noise).

    close: every |actual - expected| <= atol + rtol * max|expected| — rtol is relative to the
    output's scale, not to each element: reordered fp32 arithmetic (which every rewrite and
    onnxruntime's own optimizer do) moves a 24-layer model's logits by ~1e-4 of their scale, and
    an elementwise rtol would call that a mismatch wherever a value happens to be near zero.
    """
    a = np.asarray(actual, np.float64).ravel()
    b = np.asarray(expected, np.float64).ravel()
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    big = np.abs(b) > atol
    max_rel = float((diff[big] / np.abs(b[big])).max()) if big.any() else 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cosine = 1.0 if na == 0 and nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0
    scale = float(np.abs(b).max()) if b.size else 0.0
    close = max_abs <= atol + rtol * scale and bool(np.isfinite(a).all())
    return max_abs, max_rel, cosine, close
