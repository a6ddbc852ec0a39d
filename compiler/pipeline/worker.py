"""check's second core: the input's own verdicts and the graphs after the first (decode, ...),
built by a child process while this one builds the first.

    parent  load ─► Worker.start ─► first graph's pipeline ─► Worker.collect ─► Worker.raw
    child   load ─► the input's verdicts (a copy) ─► each later graph's pipeline ─► its placement

The child is `python -m mtkc.pipeline.worker` in its own session, killed with mtkc
(`mtkc.interrupts`). Its job arrives as JSON on stdin: the model's path, the SDK, the options
(`Options.to_json`), the options of the input's verdicts and the graphs. Its answers leave as two
JSON lines on stdout, each with the log records made for it: first its fingerprint and the input's
verdicts (`InputVerdicts`, or the error that stopped them), then each graph's placement and the
rope mode its rope pass used (or the error that stopped them). It runs the very functions the
parent would (`mtkc.pipeline.build`), so the answers are the same.

It only saves time. The parent takes an answer when:
  - the child read the same file (device, inode, size, mtime, node count) with the same mtkc;
  - for the graphs, the rope mode each graph used is the one the first graph chose: the child runs
    with the mode the user gave, so an open one is picked by each graph's own rope pass.
The parent then replays the answer's log records in order and raises its error, as if it had
made it itself. Otherwise (or when the child fails or dies) it makes it itself.
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
from typing import Any, Iterator

import mtkc
from mtkc import errors
from mtkc.interrupts import GROUPS, die_with, kill_group
from mtkc.ir.model import Model, load
from mtkc.options import Options
from mtkc.pipeline.build import InputVerdicts, Placement, build_graph, input_verdicts
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
    """One child building the input's verdicts and `variants` of `model`'s file; `collect` waits for
    its placements, `inputs` for the verdicts."""

    def __init__(self, proc: subprocess.Popen, fingerprint: list):
        self.proc, self.fingerprint, self.closed = proc, fingerprint, False
        self.answers: list[dict | None] = []  # the lines read so far (None: not an answer)

    @classmethod
    def start(cls, model: Model, options: Options, variants: list, table, jobs: int | None = None,
              inputs: Options | None = None) -> Worker | None:
        """A worker for `variants` (the plan's graphs after the first, `options` with the LLM defaults
        bound) and, given their `inputs` options, the input's verdicts; None when it would not pay
        (module docstring) or `jobs` is 1. `jobs` None: by size."""
        wanted = len(model.graph.nodes) >= MIN_NODES and cpus() >= 2 if jobs is None else jobs >= 2
        if not variants or not wanted or _user_code(options) or not _catalog(table):
            return None
        job = {"model": str(model.path), "sdk": table.version, "arch": table.arch, "options": options.to_json(),
               "inputs": inputs.to_json() if inputs is not None else None,
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
        """The child's placements, their log records replayed and their error raised; None when the
        parent must build the graphs itself (the module docstring's conditions)."""
        answer = self._answer(1)
        try:
            graphs = [(Placement(g["name"], g["partitions"], g["coverage"]), g["rope_mode"]) for g in answer["graphs"]]
            error, records = _error(answer), _records(answer)
            taken = all(m in (None, rope_mode) for _, m in graphs)
        except (KeyError, TypeError):  # not an answer
            taken = False
        if not taken:
            log.debug("mtkc: the worker's graphs are not taken (exit %s); building them here", self.proc.returncode)
            return None
        _replay(records, error)
        return [placement for placement, _ in graphs]

    def inputs(self) -> InputVerdicts | None:
        """The input's verdicts, their log records replayed and their error raised; None when the
        parent must make them itself (no such answer, or the child read another file)."""
        answer = self._answer(0)
        try:
            verdicts = None if answer["inputs"] is None else InputVerdicts.from_json(answer["inputs"])
            error, records = _error(answer), _records(answer)
        except (KeyError, TypeError, ValueError):  # not an answer
            return None
        if verdicts is None and error is None:
            return None
        _replay(records, error)
        return verdicts

    def _answer(self, i: int) -> dict | None:
        """The child's line `i` (0: fingerprint and verdicts, 1: graphs), when it is an answer from
        this file; None otherwise. Reading past the last line ends the child."""
        while len(self.answers) <= i and not self.closed:
            line = self.proc.stdout.readline()
            try:
                answer = json.loads(line)
            except ValueError:  # the child died (while writing)
                answer = None
            self.answers.append(answer if isinstance(answer, dict) else None)
            if len(self.answers) == 2 or answer is None:
                self.close()
        answer = self.answers[i] if i < len(self.answers) else None
        first = self.answers[0] if self.answers else None
        return answer if first is not None and first.get("fingerprint") == self.fingerprint else None

    def close(self) -> None:
        """Kill the child's group and reap it (once: a reaped pid may be another process's)."""
        if not self.closed:
            self.closed = True
            self.proc.stdout.close()
            kill_group(self.proc)


def _error(answer: dict) -> errors.MtkcError | None:
    error = answer["error"]
    return None if error is None else ERRORS[error["type"]](error["message"])


def _records(answer: dict) -> list[logging.LogRecord]:
    return [logging.makeLogRecord(r) for r in answer["logs"]]


def _replay(records: list[logging.LogRecord], error: errors.MtkcError | None) -> None:
    for record in records:
        log.handle(record)
    if error is not None:
        raise error


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

    def take(self) -> list[dict[str, Any]]:
        """The records so far, and none kept."""
        taken, self.records = self.records, []
        return taken


def _answers(job: dict, records: _Records) -> Iterator[dict]:
    """The child's work, one answer per line (the module docstring). The records of its load are
    dropped: the parent logged its own."""
    model = load(job["model"])
    records.records.clear()
    if job["mtkc"] != mtkc.__file__:
        yield {"fingerprint": None}
        return
    table = capability.load_table(job["sdk"], job["arch"])
    first: dict[str, Any] = {"fingerprint": _fingerprint(model.path, len(model.graph.nodes)), "inputs": None,
                             "error": None}
    if job["inputs"] is not None:
        copy = model.copy()  # before a pass touches the graph
        try:
            first["inputs"] = input_verdicts(copy, table, Options.from_json(job["inputs"])).to_json()
        except tuple(ERRORS.values()) as exc:
            first["error"] = {"type": type(exc).__name__, "message": str(exc)}
    yield {**first, "logs": records.take()}
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
    yield {"graphs": graphs, "error": error, "logs": records.take()}


def main() -> int:
    """The child: a job on stdin, its answers on stdout, a line each (exit 1 on anything else, the
    parent then does the work itself)."""
    gc.disable()  # as the parent's check (`mtkc.cli.collector`)
    job = json.loads(sys.stdin.buffer.read())
    records = _Records()
    log.handlers[:], log.propagate = [records], False
    log.setLevel(job["level"])
    for answer in _answers(job, records):
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the answer is out: not a second spent freeing the graphs
