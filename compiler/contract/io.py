"""Names, roles and dtypes of a compiled graph's inputs and outputs (DESIGN "Graph I/O names").

    inputs   input_ids int32 [1,T] | hidden_states float [1,T,H]    the tokens (host embedding)
             attention_mask float [1,1,T,C+T]                       additive (see `mask`)
             attention_mask_window_<W> float [1,1,T,C+T]            the same, for layers attending
                                                                    the last W positions only
             position_ids int32 [1,T] | pos_emb float [1,2,T,D]     positions (cos, sin rows)
             past_key_<i> / past_value_<i> float [1,Hkv,C,D]        the static cache
    outputs  logits [1,T,V] | hidden_states_out [1,T,H] (a layer chunk that is not the last)
             present_key_<i> / present_value_<i>                    see `cache` for the layouts
"""

from __future__ import annotations

import re

import numpy as np

INPUT_IDS = "input_ids"
HIDDEN_STATES = "hidden_states"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
POS_EMB = "pos_emb"
LOGITS = "logits"
HIDDEN_STATES_OUT = "hidden_states_out"
KINDS = ("key", "value")

ORDER = (INPUT_IDS, HIDDEN_STATES, ATTENTION_MASK, POSITION_IDS, POS_EMB, LOGITS, HIDDEN_STATES_OUT)
DTYPES = {INPUT_IDS: np.int32, POSITION_IDS: np.int32, HIDDEN_STATES: np.float32, ATTENTION_MASK: np.float32,
          POS_EMB: np.float32, LOGITS: np.float32, HIDDEN_STATES_OUT: np.float32}

_WINDOW_MASK = re.compile(r"^attention_mask_window_([1-9]\d*)$")
_CACHE = re.compile(r"^(past|present)_(key|value)_(\d+)$")
_ORT_TYPES = {"float": np.float32, "float16": np.float16, "double": np.float64, "int64": np.int64,
              "int32": np.int32, "bool": np.bool_, "int8": np.int8, "uint8": np.uint8}


def past(kind: str, layer: int) -> str:
    """`past_key_3`: the compiled cache input of one layer."""
    return f"past_{kind}_{layer}"


def present(kind: str, layer: int) -> str:
    """`present_key_3`: the compiled cache output of one layer."""
    return f"present_{kind}_{layer}"


def cache_name(name: str) -> tuple[str, str, int] | None:
    """("past"|"present", "key"|"value", layer) of a compiled cache name, else None."""
    m = _CACHE.match(name)
    return (m[1], m[2], int(m[3])) if m else None


def past_of(present_name: str) -> str | None:
    """The cache input a present output is written back to (`present_key_3` -> `past_key_3`)."""
    parsed = cache_name(present_name)
    return past(parsed[1], parsed[2]) if parsed and parsed[0] == "present" else None


def window_mask(window: int | None) -> str:
    """`attention_mask_window_8`: the additive mask of sliding-window layers (`attention_mask` when None)."""
    return ATTENTION_MASK if window is None else f"attention_mask_window_{int(window)}"


def mask_window(name: str) -> int | None:
    """The window of an `attention_mask_window_<W>` input, None for any other name."""
    m = _WINDOW_MASK.match(name)
    return int(m[1]) if m else None


def is_mask(name: str) -> bool:
    """`attention_mask` or a sliding-window layer's `attention_mask_window_<W>`."""
    return name == ATTENTION_MASK or mask_window(name) is not None


def order_key(name: str) -> tuple[int, int, int]:
    """Sort key of the contract order: tokens/hidden, masks (global, then by window), positions,
    outputs, then per layer key, value."""
    if name in ORDER:
        return (0, ORDER.index(name), 0)
    if mask_window(name) is not None:
        return (0, ORDER.index(ATTENTION_MASK), mask_window(name))
    parsed = cache_name(name)
    return (1, parsed[2], KINDS.index(parsed[1])) if parsed else (2, 0, 0)


def ort_dtype(ort_type: str) -> np.dtype | None:
    """numpy dtype of an onnxruntime type string (`tensor(int64)`), None when it has none here."""
    inner = ort_type.removeprefix("tensor(").removesuffix(")")
    return np.dtype(_ORT_TYPES[inner]) if inner in _ORT_TYPES else None
