"""Copy byte ranges of the source model's weight files into the files being written, on a thread of
its own.

    copier = Copier()
    copier.put(src, dst, offset, nbytes, at, what)   # queued (src duplicated); returns at once
    ...                                       # the caller goes on (its next graph's passes)
    copier.wait(dst, end)                     # every byte of dst below `end` queued so far is written
    copier.finish()                           # all written and synced; the first error raised

The copies are I/O (`copy_file_range` in the kernel; the GIL is released), so they overlap the
caller's CPU work. Each lands at the offset the caller assigned (`pwrite` semantics), so a file
is the same whatever the timing. When its queue runs dry the thread syncs the files it wrote, so
the caller's final fsync is short. A copy that fails (the source truncated or unreadable, the disk
full) stops the rest; `put` / `wait` / `finish` raise it (`copy_error`): a read error as an
InputError naming the source file and tensor, a full or read-only disk and a failed sync as the
OSError they were, for the caller to name its output folder (`mtkc.backend.staging.disk_errors`).

The thread touches Python as little as it can (one call per copy, on a duplicate of the caller's
open source file), but each call takes the GIL back from a busy caller, which can take a whole
switch interval: while it runs the interval is `SWITCH_SECONDS`, not Python's 5 ms (measured at
0.5B dims, 242 copies beside the decode graph's build: the copies ended 1.3-1.4 s after the
build with 5 ms, 0.04-0.16 s with 0.5 ms; the build itself no slower). At most `QUEUED` copies
wait (each holds a descriptor). The caller keeps every `dst`
open until `finish` or `cancel` returns.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

from mtkc.errors import FULL_DISK, InputError
from mtkc.ir.model_checks import ExternalDataError

CHUNK = 16 << 20  # bytes per read when the kernel cannot copy
KERNEL_CHUNK = 1 << 30  # bytes per copy_file_range call
PIECE = 64 << 20  # bytes a cancel may wait for (a copy is made in pieces: Ctrl-C must end mtkc within a second)


def _queued() -> int:
    """Copies allowed to wait: a quarter of the descriptors this process may open, 16 to 4096."""
    try:
        import resource
    except ImportError:
        return 64
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 4096 if soft == resource.RLIM_INFINITY else min(4096, max(16, soft // 4))


QUEUED = _queued()
SWITCH_SECONDS = 0.0005
_switch = {"threads": 0, "saved": None}  # copier threads running; the interval they replaced
_switch_lock = threading.Lock()


def _short_switches(on: bool) -> None:
    """Shorten the GIL switch interval while any copier thread runs; restore it after the last."""
    with _switch_lock:
        _switch["threads"] += 1 if on else -1
        if on and _switch["threads"] == 1:
            _switch["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_SECONDS, _switch["saved"]))
        elif not on and _switch["threads"] == 0:
            sys.setswitchinterval(_switch["saved"])


class Copier:
    """One thread copying queued ranges, in the order queued (started on the first `put`)."""

    def __init__(self):
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._running: tuple[int, int] | None = None  # (dst, at) of the copy under way
        self._unsynced: set[int] = set()
        self._stop = False
        self._cancelled = False

    def put(self, src: int, dst: int, offset: int, nbytes: int, at: int, what: str) -> None:
        """Queue `nbytes` of the open file `src` from `offset`, to land at `at` in `dst`; `what`
        names the source in an error (`file: tensor 'name'`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or len(self._jobs) < QUEUED)
            self._raise()
            self._jobs.append((os.dup(src), dst, offset, nbytes, at, what))
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtkc-weights", daemon=True)
            _short_switches(True)
            try:
                self._thread.start()
            except BaseException:
                _short_switches(False)
                raise

    def wait(self, dst: int, end: int) -> None:
        """Block until no queued or running copy lands in `dst` below `end`; the first error raised."""
        def clear() -> bool:
            return self._error is not None or not (
                (self._running is not None and self._running[0] == dst and self._running[1] < end)
                or any(job[1] == dst and job[4] < end for job in self._jobs))

        with self._cond:
            self._cond.wait_for(clear)
            self._raise()

    def finish(self) -> None:
        """Every queued copy written, the thread gone; the first error raised."""
        self._end(drop=False)
        self._raise()

    def cancel(self) -> None:
        """Drop what is queued, stop the copy under way after its current piece, end the thread
        (errors dropped)."""
        self._cancelled = True
        self._end(drop=True)

    def _end(self, drop: bool) -> None:
        with self._cond:
            if drop:
                self._drop()
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _drop(self) -> None:
        while self._jobs:
            os.close(self._jobs.popleft()[0])

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here: the copies left are not made, so `finish` must raise
            with self._cond:
                self._error, self._stop = self._error or exc, True
                self._drop()
                self._cond.notify_all()
        finally:
            _short_switches(False)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._unsynced or self._jobs or self._stop:
                    self._cond.wait_for(lambda: self._jobs or self._stop)
                    if not self._jobs:
                        return
                    job = self._jobs.popleft()
                    self._running = job[1], job[4]
                    self._unsynced.add(job[1])
                    unsynced = ()
                else:
                    job, unsynced, self._unsynced = None, sorted(self._unsynced), set()
            error = self._copy(*job) if job is not None else self._sync(unsynced)
            with self._cond:
                self._running = None
                if error is not None:
                    self._error, self._stop = error, True
                    self._drop()
                self._cond.notify_all()

    @staticmethod
    def _sync(files) -> BaseException | None:
        """The queue ran dry: sync the files written (a full disk may only say so here: raised as
        is, as the caller's own fsync would have been)."""
        try:
            for fd in files:
                getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
        except OSError as exc:
            return exc
        return None

    def _copy(self, src: int, dst: int, offset: int, nbytes: int, at: int, what: str) -> BaseException | None:
        try:
            for done in range(0, nbytes, PIECE):
                if self._cancelled:
                    break
                copy_range(src, dst, offset + done, min(PIECE, nbytes - done), at + done)
        except (ExternalDataError, OSError) as exc:
            return copy_error(exc, what)
        except BaseException as exc:  # a bug: raised in the caller's thread as it is
            return exc
        finally:
            os.close(src)
        return None


def copy_error(exc: ExternalDataError | OSError, what: str) -> BaseException:
    """What a failed copy from the source `what` (`file: tensor 'name'`) is: the written file's full
    or read-only disk as the OSError it was (the caller names its output folder), anything else an
    InputError naming the source."""
    if isinstance(exc, OSError) and exc.errno in FULL_DISK:
        return exc
    return InputError(f"{what}: {exc}")


def copy_range(src: int, dst: int, offset: int, nbytes: int, at: int) -> None:
    """Copy `nbytes` of `src` from `offset` to `dst` at `at`, in the kernel when possible, else in chunks."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < nbytes:
                n = os.copy_file_range(src, dst, min(KERNEL_CHUNK, nbytes - done), offset + done, at + done)
                if n == 0:
                    raise ExternalDataError("external data is truncated")
                done += n
            return
        except OSError:  # EXDEV, ENOSYS, EINVAL on some file systems: copy by hand
            pass
    while done < nbytes:
        block = os.pread(src, min(CHUNK, nbytes - done), offset + done)
        if not block:
            raise ExternalDataError("external data is truncated")
        done += pwrite_all(dst, block, at + done)


def pwrite_all(fd: int, data, at: int) -> int:
    """Write all of `data` (any buffer) to `fd` at `at`; returns its size in bytes."""
    view, done = memoryview(data).cast("B"), 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], at + done)
    return done
