"""check's second core: the graphs after the first (decode, ...) built by a child process while
this one builds the first.

    parent  load ─► Worker.start ─► raw verdicts ─► first graph's pipeline ─► Worker.collect
    child   load ─► each later graph's pipeline ─► its placement

The child is `python -m mtkc.pipeline.worker` in its own session, killed with mtkc
(`mtkc.interrupts`). Its job arrives as JSON on stdin: the model's path, the SDK, the options
(`Options.to_json`) and the graphs. Its answer leaves as JSON on stdout: each graph's placement and
the rope mode its rope pass used, the log records it made, or the error that stopped it. It runs
the very functions the parent would (`mtkc.pipeline.build`), so the placements are the same.

It only saves time. The parent takes the answer when:
  - the rope mode each graph used is the one the first graph chose: the child runs with the mode the
    user gave, so an open one is picked by each graph's own rope pass;
  - the child read the same file (device, inode, size, mtime, node count) with the same mtkc.
The parent then replays the child's log records in order and raises its error, as if it had built
the graphs itself. Otherwise (or when the child fails or dies) it builds them itself.
Not started when a pass is not built in (a plugin's or an entry point's: the user's code would run
twice), for a table not from mtkc's catalog, or, unless asked (`jobs` 2), on one CPU or for a graph
under MIN_NODES (starting a child costs more than the graph).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mtkc
from mtkc import errors
from mtkc.interrupts import GROUPS, die_with, kill_group
from mtkc.ir.model import Model, load
from mtkc.options import Options
from mtkc.pipeline.build import Placement, build_graph
from mtkc.pipeline.registry import builtin_passes
from mtkc.target import capability
from mtkc.target.model import Table

log = logging.getLogger("mtkc")

COMMAND = [sys.executable, "-m", "mtkc.pipeline.worker"]
MIN_NODES = 5_000  # measured: 618 nodes +0.5 s with a child, 6184 nodes (0.5B, 24 layers) -0.9 s
ERRORS = {c.__name__: c for c in (errors.InputError, errors.PassError, errors.InternalError)}


def cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Worker:
    """One child building `variants` of `model`'s file; `collect` waits for its placements."""

    def __init__(self, proc: subprocess.Popen, fingerprint: list):
        self.proc, self.fingerprint, self.closed = proc, fingerprint, False

    @classmethod
    def start(cls, model: Model, options: Options, variants: list, table, jobs: int | None = None) -> Worker | None:
        """A worker for `variants` (the plan's graphs after the first, `options` with the LLM defaults
        bound); None when it would not pay (module docstring) or `jobs` is 1. `jobs` None: by size."""
        wanted = len(model.graph.nodes) >= MIN_NODES and cpus() >= 2 if jobs is None else jobs >= 2
        if not variants or not wanted or _user_code(options) or not _catalog(table):
            return None
        job = {"model": str(model.path), "sdk": table.version, "arch": table.arch, "options": options.to_json(),
               "variants": [{"name": v.name, "options": v.options} for v in variants],
               "level": log.getEffectiveLevel(), "mtkc": mtkc.__file__}
        proc = subprocess.Popen(COMMAND, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with(os.getpid()))
        GROUPS.add(proc.pid)
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except OSError:  # the child is gone already: collect says so
            pass
        return cls(proc, _fingerprint(model.path, len(model.graph.nodes)))

    def collect(self, rope_mode: str | None) -> list[Placement] | None:
        """The child's placements, its log records replayed and its error raised; None when the
        parent must build the graphs itself (the module docstring's conditions)."""
        try:
            out = self.proc.stdout.read()  # to the end: the child wrote all or died
        finally:
            self.close()
        try:
            answer = json.loads(out)
            graphs = [(Placement(g["name"], g["partitions"], g["coverage"]), g["rope_mode"]) for g in answer["graphs"]]
            error = None if answer["error"] is None else ERRORS[answer["error"]["type"]](answer["error"]["message"])
            records = [logging.makeLogRecord(r) for r in answer["logs"]]
            taken = answer["fingerprint"] == self.fingerprint and all(m in (None, rope_mode) for _, m in graphs)
        except (ValueError, KeyError, TypeError):  # not an answer: the child died while writing it
            taken = False
        if not taken:
            log.debug("mtkc: the worker's graphs are not taken (exit %s); building them here", self.proc.returncode)
            return None
        for record in records:
            log.handle(record)
        if error is not None:
            raise error
        return [placement for placement, _ in graphs]

    def close(self) -> None:
        """Kill the child's group and reap it (once: a reaped pid may be another process's)."""
        if not self.closed:
            self.closed = True
            self.proc.stdout.close()
            kill_group(self.proc)


def _user_code(options: Options) -> bool:
    """Whether the pipeline may run a pass that is not built in (a plugin file or module, an entry point)."""
    return bool(options.plugins) or not set(options.passes or ()) <= set(builtin_passes())


def _catalog(table) -> bool:
    """Whether `table` is the catalog's own for its SDK and arch (the one the child loads)."""
    if not isinstance(table, Table):
        return False
    try:
        return capability.load_table(table.version, table.arch) == table
    except errors.MtkcError:
        return False


def _fingerprint(path: Path, nodes: int) -> list:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, nodes, mtkc.__file__]


class _Records(logging.Handler):
    """Keeps every record as the dict `logging.makeLogRecord` takes back (message formatted)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                             "msg": record.getMessage(), "args": None})


def _answer(job: dict, records: _Records) -> dict:
    """The child's work: each graph's placement, or the error of the first graph that fails (the
    records of its load dropped: the parent logged its own)."""
    model = load(job["model"])
    records.records.clear()
    fingerprint = _fingerprint(model.path, len(model.graph.nodes))
    if job["mtkc"] != mtkc.__file__:
        return {"fingerprint": None, "graphs": [], "error": None}
    table = capability.load_table(job["sdk"], job["arch"])
    options = Options.from_json(job["options"])
    graphs, error, variants = [], None, job["variants"]
    try:
        for i, v in enumerate(variants, 1):
            start = model if i == len(variants) else model.copy()
            built = build_graph(start, v["name"], options.replace(**v["options"]), table, None)
            rope = next((p for p in built.compiled.pipeline.passes if p.name == "rope"), None)
            graphs.append({"name": built.name, "partitions": built.partitions, "coverage": built.coverage,
                           "rope_mode": rope.mode if rope is not None else None})
    except tuple(ERRORS.values()) as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {"fingerprint": fingerprint, "graphs": graphs, "error": error}


def main() -> int:
    """The child: a job on stdin, its answer on stdout (exit 1 on anything else, the parent then
    builds the graphs itself)."""
    gc.disable()  # as the parent's check (`mtkc.cli.collector`)
    job = json.loads(sys.stdin.buffer.read())
    records = _Records()
    log.handlers[:], log.propagate = [records], False
    log.setLevel(job["level"])
    answer = _answer(job, records)
    answer["logs"] = records.records
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the answer is out: not a second spent freeing the graphs
