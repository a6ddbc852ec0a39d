"""Numeric agreement of two arrays: the one comparison verify and --verify-each share."""

from __future__ import annotations

import numpy as np

COMPARE_BLOCK = 1 << 20  # elements per float64 block in `compare`


def compare(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[float, float, float, bool]:
    """(max abs, max rel, cosine, close). Rel error is taken where |expected| > atol (no 0/0 noise).

    close: every |actual - expected| <= atol + rtol * max|expected| — rtol is relative to the
    output's scale, not to each element: reordered fp32 arithmetic (which every rewrite and
    onnxruntime's own optimizer do) moves a 24-layer model's logits by ~1e-4 of their scale, and
    an elementwise rtol would call that a mismatch wherever a value happens to be near zero.
    Computed in blocks of float64 (a 0.5B model's logits are 78 MB of fp32: whole-array float64
    temporaries cost ~1 GB of peak memory).
    """
    a_all, b_all = np.ravel(actual), np.ravel(expected)
    max_abs = max_rel = scale = dot = na2 = nb2 = 0.0
    finite = True
    for start in range(0, a_all.size, COMPARE_BLOCK):
        a = a_all[start:start + COMPARE_BLOCK].astype(np.float64)
        b = b_all[start:start + COMPARE_BLOCK].astype(np.float64)
        diff, size = np.abs(a - b), np.abs(b)
        max_abs, scale = float(np.maximum(max_abs, diff.max())), float(np.maximum(scale, size.max()))  # NaN stays
        big = size > atol
        if big.any():
            max_rel = max(max_rel, float((diff[big] / size[big]).max()))
        dot, na2, nb2 = dot + float(a @ b), na2 + float(a @ a), nb2 + float(b @ b)
        finite = finite and bool(np.isfinite(a).all()) and bool(np.isfinite(b).all())
    na, nb = np.sqrt(na2), np.sqrt(nb2)
    cosine = 1.0 if na == 0 and nb == 0 else float(dot / (na * nb)) if na and nb else 0.0
    close = max_abs <= atol + rtol * scale and finite
    return max_abs, max_rel, cosine, close
