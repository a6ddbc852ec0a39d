"""How each exporter spells layer i's cache tensors, and their map onto the contract's names.

    optimum / torch legacy + dynamo    past_key_values.{i}.key      present.{i}.key
    onnxruntime-genai, legacy          past.{i}.key                 present.{i}.key
    transformers' own exporter         input.cache.layers.{i}.keys  output.cache.layers.{i}.keys
    mtkc (compiled)                    past_key_{i}                 present_key_{i}

A name none of these match may still be a cache tensor (found by structure, e.g. dynamo's
flattened `cache_0..`): `cache_entries` pairs unmatched 4-D tensors by position instead.
"""

from __future__ import annotations

import re

from mtkc.contract import io

_SPELLINGS = [
    re.compile(r"^(?P<io>past|present)_(?P<kind>key|value)_(?P<i>\d+)$"),
    re.compile(r"^(?:(?P<io>past|present)(?:_key_values)?|(?P<hf>input|output)\.cache\.layers)"
               r"[._](?P<i>\d+)[._](?P<kind>key|value)s?$"),
]
_HF_IO = {"input": "past", "output": "present"}


def recognise(name: str) -> tuple[str, str, int] | None:
    """("past"|"present", "key"|"value", layer) for any known exporter spelling of a cache tensor."""
    for pattern in _SPELLINGS:
        m = pattern.match(name)
        if m:
            return (m["io"] or _HF_IO[m["hf"]], m["kind"], int(m["i"]))
    return None


def contract_name(name: str) -> str | None:
    """The compiled name of an exporter's cache tensor (`past_key_values.3.key` -> `past_key_3`)."""
    found = recognise(name)
    if found is None:
        return None
    kind, layer = found[1], found[2]
    return io.past(kind, layer) if found[0] == "past" else io.present(kind, layer)


def cache_entries(names: list[str], ranks: list[int | None], io_: str) -> list[tuple[str, str, int]]:
    """(name, kind, layer) of the cache tensors among a graph's inputs (`io_`="past") or outputs
    ("present"): recognised spellings, else every other 4-D tensor paired key, value by order."""
    found = [(n, r[1], r[2]) for n in names if (r := recognise(n)) and r[0] == io_]
    if found:
        return sorted(found, key=lambda e: (e[2], io.KINDS.index(e[1])))
    rest = [n for n, rank in zip(names, ranks) if rank == 4]
    if len(rest) % 2:
        return []
    return [(n, io.KINDS[k % 2], k // 2) for k, n in enumerate(rest)]
