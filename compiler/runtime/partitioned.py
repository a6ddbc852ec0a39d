"""Run a compiled graph as its partitions, with a chosen session per partition and a tap on each.

The reference runtime (`mtkc.runtime.generate.Generator`) drives whole graphs; `use_partitions`
swaps each graph's session for a `GraphRunner`, so prefill/decode, the cache and the host tables
stay the Generator's while every call goes through the pieces the device runs:

    Generator.step ─► GraphRunner.run(feed) ─► partition 0 ─► partition 1 ─► ... (manifest order)
                                                  │ on_partition(graph, partition, inputs, outputs)

Calibration records each NPU partition's inputs there; the quantisation simulation swaps the NPU
partitions' sessions for quantised ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from mtkc.runtime.graphs import load_session, run_partitions

Tap = Callable[[dict, dict, dict[str, np.ndarray], dict[str, np.ndarray]], None]


class PartitionSession:
    """One partition's session; reports its inputs and outputs to `tap`."""

    def __init__(self, session, graph: dict, part: dict, tap: Tap | None = None):
        self.session, self.graph, self.part, self.tap = session, graph, part, tap
        self.names = [o.name for o in session.get_outputs()]  # may hold extra (probe) outputs

    def run(self, names, feed):
        values = dict(zip(self.names, self.session.run(self.names, feed)))
        if self.tap:
            self.tap(self.graph, self.part, feed, values)
        return [values[n] for n in names]


class GraphRunner:
    """Stands in for a whole graph's session: runs its partitions in manifest order."""

    def __init__(self, out: Path, graph: dict, sessions: dict):
        self.out, self.graph, self.sessions = Path(out), graph, sessions

    def run(self, names, feed):
        outputs = run_partitions(self.out, self.graph, feed, self.sessions)
        return [outputs[n] for n in names]


def partition_sessions(out: Path, manifest: dict, tap: Tap | None = None,
                       make: Callable[[dict, dict], object] | None = None) -> dict:
    """{partition path: PartitionSession} for every partition: the session `make(graph, part)` returns
    (e.g. a quantised model), else one of the partition file."""
    sessions = {}
    for graph in manifest.get("graphs", []):
        for part in graph["partitions"]:
            path = Path(out) / part["path"]
            sessions[path] = PartitionSession(make(graph, part) if make else load_session(path), graph, part, tap)
    return sessions


def use_partitions(generator, manifest: dict, sessions: dict) -> None:
    """Route every stage of `generator` through its graph's partitions (sessions from `partition_sessions`)."""
    graphs = {g["name"]: g for g in manifest.get("graphs", [])}
    for stage in generator.prefill + generator.decode:
        stage.session = GraphRunner(generator.root, graphs[stage.name], sessions)
