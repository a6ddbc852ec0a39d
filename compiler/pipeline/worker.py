"""check's second core: forks of mtkc do what needs the input as loaded while this process builds
the first graph.

    parent  load ─► fork, fork ─► first graph's pipeline ─► collect: raw verdicts, later graphs
    child 1            └► the input's raw verdicts (`Worker.raw`)
    child 2            └► each later graph's pipeline ─► its placement (`Worker.later`)

A child is forked right after the load (Linux): it starts from the graph as loaded, shared
copy-on-write, so nothing is read, parsed or copied again, and it runs the very functions the
parent would (`mtkc.pipeline.build`). It is in its own process group, killed with mtkc
(`mtkc.interrupts.fork`), with stdin, stdout and stderr on /dev/null. Its answer leaves as JSON
on a pipe: the result, the log records it made, or the error that stopped it. The parent replays
the records in order and raises the error, as if it had done the work itself.

It only saves time. The parent does the work itself when the child dies or its answer is not one,
and takes the later graphs only when the rope mode each used is the one the first graph chose (the
child runs with the mode the user gave, so an open one is picked by each graph's own rope pass).
No child runs without `os.fork` (not Linux), when the system cannot fork one, in a process running
threads other than mtkc's watchdog (a host program's: a fork copies the locks they hold), with
`jobs` 1 or, unless asked (`jobs` 2), on one CPU or for a graph under MIN_NODES; and no child builds
later graphs when a pass is not built in (a plugin's or an entry point's: the user's code would run
twice).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Callable

from mtkc import errors
from mtkc.interrupts import FORKS, WATCHDOG_THREAD, fork, kill_group
from mtkc.ir.model import Model
from mtkc.options import Options
from mtkc.passes.qdq import quantization_state
from mtkc.pipeline.build import Placement, build_graph, raw_assessment
from mtkc.pipeline.registry import builtin_passes
from mtkc.target.assess import Assessment

log = logging.getLogger("mtkc")

MIN_NODES = 5_000  # measured with a fresh interpreter per child: 618 nodes +0.5 s, 6184 nodes (0.5B) -0.9 s
ERRORS = {c.__name__: c for c in (errors.InputError, errors.PassError, errors.InternalError)}


def cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def wanted(model: Model, jobs: int | None) -> bool:
    """Whether children pay for `model` (`jobs` None: by size and CPUs; 1: never; 2: always). Never
    in a process running threads of its own (a host program's: a fork copies the locks they hold)."""
    if not FORKS or _other_threads():
        return False
    return len(model.graph.nodes) >= MIN_NODES and cpus() >= 2 if jobs is None else jobs >= 2


def _other_threads() -> list[str]:
    """The names of the threads running beside this one, mtkc's watchdog aside (tqdm's monitor, a
    server's pool: whatever a host program started)."""
    return [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.name != WATCHDOG_THREAD]


class Worker:
    """One forked child computing `job()`, a JSON-able result; `answer` waits for it."""

    def __init__(self, job: Callable[[], Any]):
        read, write = os.pipe()

        def child() -> None:
            os.close(read)
            _child(job, write)

        try:
            self.pid = fork(child)
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        self.pipe, self.closed = read, False
        self.taken: tuple[Any, Exception | None] | None = None  # (result, error), once read

    @classmethod
    def raw(cls, model: Model, table, options: Options) -> Worker | None:
        """The input's raw verdicts (`raw_assessment`), its unbound dims and quantization state;
        `raw_answer` takes them."""
        def job() -> dict:
            assessment, unbound = raw_assessment(model, table, options)
            return {"assessment": assessment.to_json(), "unbound": unbound,
                    "quantization": quantization_state(model.graph)}
        return cls._start(job)

    @classmethod
    def later(cls, model: Model, options: Options, variants: list, table) -> Worker | None:
        """The plan's graphs after the first (`options` with the LLM defaults bound), built as
        `build` would; `collect` takes their placements. None when there are none or a pass is not
        built in (the module docstring)."""
        if not variants or _user_code(options):
            return None

        def job() -> list[dict]:
            graphs = []
            for i, v in enumerate(variants, 1):
                start = model if i == len(variants) else model.copy()
                built = build_graph(start, v.name, options.replace(**v.options), table, None)
                rope = next((p for p in built.compiled.pipeline.passes if p.name == "rope"), None)
                graphs.append({"name": built.name, "partitions": built.partitions, "coverage": built.coverage,
                               "rope_mode": rope.mode if rope is not None else None})
            return graphs
        return cls._start(job)

    @classmethod
    def _start(cls, job: Callable[[], Any]) -> Worker | None:
        """A child for `job`, or None when the system cannot fork one now (this process does the work)."""
        try:
            return cls(job)
        except OSError as exc:
            log.debug("mtkc: no worker (%s); doing its work here", exc)
            return None

    def answer(self) -> Any:
        """The child's result, its log records replayed (once) and its error raised (each time);
        None when it gave no answer (it died, or wrote something else)."""
        if self.taken is None:
            self.taken = self._read()
        result, error = self.taken
        if error is not None:
            raise error
        return result

    def _read(self) -> tuple[Any, Exception | None]:
        try:
            data = b"".join(iter(lambda: os.read(self.pipe, 1 << 20), b""))  # to the end: all, or it died
        finally:
            self.close()
        try:
            answer = json.loads(data)
            error = None if answer["error"] is None else ERRORS[answer["error"]["type"]](answer["error"]["message"])
            records = [logging.makeLogRecord(r) for r in answer["logs"]]
            result = answer["result"]
        except (ValueError, KeyError, TypeError):
            log.debug("mtkc: a worker gave no answer; doing its work here")
            return None, None
        for record in records:
            log.handle(record)
        return result, error

    def raw_answer(self) -> tuple[Assessment, list[str], dict] | None:
        """`raw`'s verdicts, unbound dims and quantization state, or None (see `answer`)."""
        result = self.answer()
        try:
            return result and (Assessment.from_json(result["assessment"]), list(result["unbound"]),
                               dict(result["quantization"]))
        except (KeyError, TypeError, ValueError):
            log.debug("mtkc: the worker's verdicts are not taken; judging the input here")
            return None

    def collect(self, rope_mode: str | None) -> list[Placement] | None:
        """`later`'s placements (`build`'s `ahead`), or None when the parent must build the graphs
        itself: no answer, or a rope mode other than `rope_mode`."""
        graphs = self.answer()
        try:
            if graphs is not None and all(g["rope_mode"] in (None, rope_mode) for g in graphs):
                return [Placement(g["name"], g["partitions"], g["coverage"]) for g in graphs]
        except (KeyError, TypeError):
            pass
        log.debug("mtkc: the worker's graphs are not taken; building them here")
        return None

    def close(self) -> None:
        """Kill the child's group and reap it (once: a reaped pid may be another process's)."""
        if not self.closed:
            self.closed = True
            os.close(self.pipe)
            kill_group(self.pid)


def _user_code(options: Options) -> bool:
    """Whether the pipeline may run a pass that is not built in (a plugin file or module, an entry point)."""
    return bool(options.plugins) or not set(options.passes or ()) <= set(builtin_passes())


class _Records(logging.Handler):
    """Keeps every record as the dict `logging.makeLogRecord` takes back (message formatted)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                             "msg": record.getMessage(), "args": None})


def _child(job: Callable[[], Any], pipe: int) -> None:
    """Run `job` in the fork (stdio on /dev/null, log records kept) and write its answer to `pipe`;
    anything unexpected ends the child without one (the parent then does the work itself)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    records = _Records()
    log.handlers[:], log.propagate = [records], False
    try:
        result, error = job(), None
    except tuple(ERRORS.values()) as exc:
        result, error = None, {"type": type(exc).__name__, "message": str(exc)}
    _reply(pipe, {"result": result, "error": error, "logs": records.records})


def _reply(pipe: int, answer: dict) -> None:
    data = memoryview(json.dumps(answer).encode())
    while data:
        data = data[os.write(pipe, data):]
