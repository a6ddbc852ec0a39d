"""Position rules of the compiled graphs (`position_ids` int32 [1,T], or `pos_emb` rows of them).

The k real tokens of a call are at positions filled..filled+k-1 (filled = tokens already in the
cache); the T-k padding rows after them repeat the last real position (their outputs are never
used, and a position inside the RoPE table keeps them finite).
"""

from __future__ import annotations

import numpy as np


def of_call(filled: int, seq: int, real: int) -> np.ndarray:
    """[seq] positions of one call of `seq` rows of which the first `real` are tokens."""
    return filled + np.minimum(np.arange(seq), max(real, 1) - 1)


def rope_rows(table: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`pos_emb` [1,2,T,D] from a host table [2,P,D] (cos, sin) at `positions`."""
    return np.asarray(table[:, np.asarray(positions).reshape(-1)], np.float32)[None]
