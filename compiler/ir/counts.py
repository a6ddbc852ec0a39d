"""Work counters: graph imports and copies, pipeline runs, shape inferences, onnxruntime sessions, and the
seconds spent inside onnxruntime (loading sessions, running them).

What a command costs in the steps that dominate its time, for the tests that hold those numbers
and for `benchmarks/bench.py` (a command's time over its seconds in onnxruntime runs is its
overhead over the bare forward passes); `COUNTS.clear()`/`SECONDS.clear()` before a run, read after.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

COUNTS: Counter[str] = Counter()
SECONDS: Counter[str] = Counter()


def count(what: str) -> None:
    COUNTS[what] += 1


@contextmanager
def timed(what: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[what] += time.perf_counter() - start
