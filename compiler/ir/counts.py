"""Work counters: graph imports, pipeline runs, shape inferences, onnxruntime sessions.

What a command costs in the steps that dominate its time, for the tests that hold those numbers
and for `benchmarks/bench.py`; `COUNTS.clear()` before a run, read after.
"""

from __future__ import annotations

from collections import Counter

COUNTS: Counter[str] = Counter()


def count(what: str) -> None:
    COUNTS[what] += 1
