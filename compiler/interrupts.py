"""Ctrl-C and SIGTERM end mtkc within a second, whatever it is running; long calls have deadlines.

Python runs a signal handler only between bytecodes of the main thread, so a signal during a long
onnxruntime call (a Loop of 10^12 iterations, a session over 100k initializers) would wait for
that call. `installed()` (the CLI) makes SIGINT/SIGTERM raise KeyboardInterrupt, so staging is
removed and converters are killed on the way out, and starts a watchdog thread that the signal
itself wakes (`signal.set_wakeup_fd`, written by the C handler even while the main thread is in
native code):

    signal            every `deadline` in flight is stopped (onnxruntime: RunOptions.terminate);
                      the main thread unwinds, or GRACE seconds later the watchdog exits 130
    second signal     exits 130 at once
    deadline passed   its `stop` runs and the main thread raises `Expired`; a call that cannot be
                      stopped (a session being created) gets GRACE seconds, then exit `code`

Exiting from the watchdog removes every staging folder in STAGES, kills every process group in
GROUPS, and prints one line. Without `installed()` (the Python API) signals and deadlines are the
host's business: nothing is stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from mtkc.display import escape

GRACE = 0.8  # seconds between a stop and the exit that follows if the main thread is still stuck
STAGES: set[Path] = set()  # staging folders being written (`mtkc.backend.staging`)
_PR_SET_PDEATHSIG = 1
_PRCTL = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
GROUPS: set[int] = set()  # child process groups running now (`mtkc.backend.handoff`)
WATCHDOG_THREAD = "mtkc-watchdog"  # the one thread a `fork` may leave behind (it only waits in select)
FORKS = hasattr(os, "fork") and sys.platform.startswith("linux")  # where mtkc forks workers (`fork`)


class Expired(Exception):
    """A deadline passed and its call was stopped."""


@dataclass(eq=False)
class _Deadline:
    at: float
    code: int
    message: str
    stop: Callable[[], None] | None
    expired: bool = False


class _Watchdog:
    def __init__(self):
        self.lock = threading.Lock()
        self.deadlines: set[_Deadline] = set()
        self.signals = 0
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name=WATCHDOG_THREAD, daemon=True)

    def _loop(self) -> None:
        while True:
            with self.lock:
                nearest = min((d.at for d in self.deadlines), default=None)
            wait = None if nearest is None else max(0.0, nearest - time.monotonic())
            if select.select([self.read], [], [], wait)[0]:
                got = os.read(self.read, 64)  # signal numbers (the C handler), or 0: re-read the deadlines
                if self.closing:
                    return
                if any(got):
                    self._signalled(sum(1 for b in got if b))
            self._expire()

    def _signalled(self, count: int) -> None:
        self.signals += count
        if self.signals > 1:
            hard_exit(130, "mtkc: interrupted")
        with self.lock:
            stopping = list(self.deadlines)
            self.deadlines.add(_Deadline(time.monotonic() + GRACE, 130, "mtkc: interrupted", None))
        for d in stopping:
            if d.stop is not None:
                d.stop()

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            due = [d for d in self.deadlines if d.at <= now]
        for d in due:
            if d.stop is None or d.expired:
                hard_exit(d.code, d.message)
            d.expired = True
            d.at = now + GRACE
            d.stop()

    def close(self) -> None:
        self.closing = True
        os.write(self.write, b"\0")
        self.thread.join()
        os.close(self.read)
        os.close(self.write)


_WATCHDOG: _Watchdog | None = None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Signals and deadlines handled as the module docstring says, for the duration of one command
    (the previous handlers come back after it: the CLI's `main` can be called again)."""
    global _WATCHDOG
    if threading.current_thread() is not threading.main_thread() or _WATCHDOG is not None:
        yield  # only the main thread may set signal handlers; an outer command already did
        return
    watchdog = _Watchdog()
    seen = []

    def interrupt(signum, frame):
        if seen:
            hard_exit(130, "mtkc: interrupted")  # code that swallowed the first (a plugin's `except:`)
        seen.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    old_fd = signal.set_wakeup_fd(watchdog.write, warn_on_full_buffer=False)
    watchdog.thread.start()
    _WATCHDOG = watchdog
    try:
        yield
    finally:
        _WATCHDOG = None
        signal.set_wakeup_fd(old_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        watchdog.close()


@contextlib.contextmanager
def deadline(seconds: float, message: str, stop: Callable[[], None] | None = None, code: int = 2) -> Iterator[None]:
    """Bound the block to `seconds`: then `stop()` runs (and the block raises Expired when it ends),
    or, without `stop` or when the block still runs GRACE seconds later, mtkc exits `code` printing
    `mtkc: error: message`. Also stopped by a signal. Does nothing outside `installed()`."""
    watchdog = _WATCHDOG
    if watchdog is None:
        yield
        return
    entry = _Deadline(time.monotonic() + seconds, code, f"mtkc: error: {escape(message)}", stop)
    with watchdog.lock:
        watchdog.deadlines.add(entry)
    _wake(watchdog)
    try:
        yield
    except Exception:
        if entry.expired:  # what the stopped call raised
            raise Expired(message) from None
        raise
    finally:
        with watchdog.lock:
            watchdog.deadlines.discard(entry)
    if entry.expired:
        raise Expired(message)


def interrupted() -> bool:
    """A signal arrived during the current command."""
    return _WATCHDOG is not None and _WATCHDOG.signals > 0


def _wake(watchdog: _Watchdog) -> None:
    """Make the watchdog re-read its deadlines."""
    with contextlib.suppress(BlockingIOError):
        os.write(watchdog.write, b"\0")


def hard_exit(code: int, line: str) -> None:
    """Remove staging, kill child process groups, print `line`, exit `code` (from any thread)."""
    for group in list(GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    for stage in list(STAGES):
        shutil.rmtree(stage, ignore_errors=True)
    with contextlib.suppress(Exception):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    os._exit(code)


def die_with(parent: int):
    """A `preexec_fn` for a child mtkc starts (Linux): SIGKILL when mtkc dies, even by SIGKILL
    (PR_SET_PDEATHSIG; what the child itself starts is killed with its group on every other way out)."""
    if _PRCTL is None:
        return None
    return lambda: _die_with(parent)


def _die_with(parent: int) -> None:
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # mtkc died before the call above took effect
            os._exit(137)


def fork(child: Callable[[], None]) -> int:
    """Fork a child that mtkc's exits end and run `child()` in it; the child's pid (its process
    group, registered in GROUPS). The child exits 0 after `child()`, 1 when it raised: it never
    returns into the caller's code, and runs no atexit handler or buffer flush of the parent's."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _forked(parent)
            child()
            code = 0
        finally:
            os._exit(code)
    with contextlib.suppress(OSError):  # the child may have set it already, or be gone
        os.setpgid(pid, pid)
    GROUPS.add(pid)
    return pid


def _forked(parent: int) -> None:
    """Make this process, just forked from mtkc (`parent`), a child that mtkc's exits end: its own
    process group (the parent sets it too: killable at once), SIGKILL when the parent dies
    (Linux), the default signal handlers, and none of the parent's watchdog (the fork has no
    thread running it), child groups or staging folders."""
    global _WATCHDOG
    os.setpgid(0, 0)
    _die_with(parent)
    _WATCHDOG = None  # deadlines do nothing here, as in any process outside `installed()`
    GROUPS.clear()
    STAGES.clear()
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def kill_group(proc: subprocess.Popen | int) -> None:
    """SIGKILL the process group of `proc` (a child in its own group, and anything it started; a
    Popen, or the pid of a fork), reap it and forget it (GROUPS)."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if isinstance(proc, int):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    else:
        proc.wait()
    GROUPS.discard(pid)
