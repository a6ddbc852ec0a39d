"""Static cache layouts: how compiled graphs return the cache and how a runtime keeps it.

Every layer's cache input is [1,Hkv,C,D] (C = cache_len slots); a runtime keeps `valid[C]`,
which slots hold a token (the mask hides the others).

    new      present_* = the T new entries [1,Hkv,T,D]; the runtime writes the k real ones at
             the next free slots (filled..filled+k-1): the cache fills from slot 0.
    sliding  present_* = concat(past, new)[T:] [1,Hkv,C,D] (MediaTek's sliding cache), fed back
             as the next past as is: the slots slide left by T and `valid` slides with them.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("new", "sliding")
DEFAULT_LAYOUT = "new"
DEFAULT_SEQ_LEN = 128  # MediaTek's LLM convention: prefill T, cache C, batch 1
DEFAULT_CACHE_LEN = 512


def fits(layout: str, valid: np.ndarray, filled: int, seq: int, real: int) -> bool:
    """Whether a call of `real` tokens (padded to `seq` rows) keeps every cached token."""
    if layout == "sliding":
        return not valid[:seq].any()
    return filled + real <= len(valid)


def store(layout: str, past: np.ndarray, present: np.ndarray, filled: int, real: int) -> np.ndarray:
    """The next cache input of one layer after a call (updates `past` in place for `new`)."""
    if layout == "sliding":
        return present
    past[:, :, filled:filled + real] = present[:, :, :real]
    return past


def advance(layout: str, valid: np.ndarray, filled: int, seq: int, real: int) -> np.ndarray:
    """`valid` after a call of `real` tokens padded to `seq` rows."""
    if layout == "sliding":
        return np.concatenate([valid, np.arange(seq) < real])[seq:]
    valid = valid.copy()
    valid[filled:filled + real] = True
    return valid


def from_outputs(full: np.ndarray, layout: str, seq: int, cache: int) -> np.ndarray:
    """What a graph with full presents [.., C+T, D] (the export's concat) returns in `layout`."""
    return full[:, :, cache:, :] if layout == "new" else full[:, :, seq:, :]
