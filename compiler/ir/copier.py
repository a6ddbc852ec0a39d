"""Copy byte ranges of the source model's weight files into the files being written, in a process
of their own.

    copier = Copier()
    copier.put(src, dst, offset, nbytes, at, what)   # queued (the descriptors duplicated); returns at once
    copier.flush()                            # the queued copies start (sent to the child)
    ...                                       # the caller goes on (its next graph's passes)
    copier.wait(dst, end)                     # every byte of dst below `end` queued so far is written
    copier.finish()                           # all written and synced; the first error raised

The copies are I/O (`copy_file_range` in the kernel), so they overlap the caller's CPU work. They
run in a fork of the caller (Linux), made on the first `flush` or ahead by `prestart` (the CLI forks
it before compile's imports, `compile_model` before the load: it holds no graph), not on a thread: a
thread needs the GIL back after every copy, and the caller holds it through whole C calls (ONNX's
shape inference: measured, 2.5 GB beside a loop of them took 8.7-9.3 s on a thread against 0.8 s
alone). Jobs reach the child on a socket with their descriptors (SCM_RIGHTS), in batches: a graph's
copies are sent when it is written (`flush`), so the socket's small buffer never makes the caller
wait for the child (one message per job did: 2.8 s to write a 48-layer prefill, against 0.16 s). The
child answers only when asked (`wait`, `finish`: a ping, answered once every job before it is done)
or with the error that stopped it, so it never waits for a caller that is busy building (answers to
every job did: at 48 layers the child stalled after 279 of 483 copies until the caller next read).
Each copy lands at the offset the caller assigned (`pwrite` semantics), so a file is the same
whatever the timing. When its queue runs dry (`DRY_SECONDS` without a job: the caller builds its
next graph) the child syncs the files it wrote, so the caller's final fsync is short (not after each
job: a child faster than the caller's queueing would sync after nearly every one). A copy that fails
(the source truncated or unreadable, the disk full) stops the rest; `put` / `wait` / `finish` raise
it (`copy_error`): a read error as an InputError naming the source file and tensor, a full or
read-only disk and a failed sync as the OSError they were, for the caller to name its output folder
(`mtkc.backend.staging.disk_errors`). `cancel` kills the child at once. The child runs nothing but
these system calls, so unlike check's workers it is forked beside a host's threads too. Without a
fork (not Linux) `put` copies before it returns.
"""

from __future__ import annotations

import json
import os
import select
import socket

from mtkc.errors import FULL_DISK, ExternalDataError, InputError
from mtkc.interrupts import FORKS, fork, kill_group

CHUNK = 16 << 20  # bytes per read when the kernel cannot copy
KERNEL_CHUNK = 1 << 30  # bytes per copy_file_range call
MESSAGE = 1 << 20  # bytes of one message either way (a batch of jobs, an answer)
BATCH = 240  # descriptors in one batch (the kernel takes at most 253 in a message)
DRY_SECONDS = 0.05  # no job for this long: the queue ran dry (a graph's jobs come milliseconds apart)


class Copier:
    """One child copying queued ranges, in the order queued (`prestart`'s, or forked on the first `flush`)."""

    def __init__(self):
        self._sock: socket.socket | None = None
        self._pid: int | None = None
        self._files: set[int] = set()  # destinations the child has a descriptor of
        self._pending: list[tuple[int, int]] = []  # (dst, at) of the jobs queued since the child last said all were done
        self._batch: list[dict] = []  # jobs not sent yet, and the descriptors they name (duplicates)
        self._fds: list[int] = []
        self._pings = 0
        self._error: BaseException | None = None
        self._ended = False

    def put(self, src: int, dst: int, offset: int, nbytes: int, at: int, what: str) -> None:
        """Queue `nbytes` of the open file `src` from `offset`, to land at `at` in `dst`; `what`
        names the source in an error (`file: tensor 'name'`). Sent to the child in batches
        (`flush`; a batch of `BATCH` is sent at once)."""
        self._raise()
        if not FORKS:
            error = _copy(os.dup(src), dst, offset, nbytes, at, what)
            if error is not None:
                raise error
            return
        job = {"src": len(self._fds), "dst": dst, "offset": offset, "nbytes": nbytes, "at": at, "what": what}
        self._fds.append(os.dup(src))  # the caller may close its own now
        if dst not in self._files:
            job["new"] = len(self._fds)
            self._fds.append(os.dup(dst))
            self._files.add(dst)
        self._batch.append(job)
        self._pending.append((dst, at))
        if len(self._fds) >= BATCH:
            self.flush()

    def flush(self) -> None:
        """Send the jobs queued since the last batch to the child (the caller's graph is written:
        its copies start now)."""
        if not self._batch:
            return
        if self._pid is None:
            self._start()
        batch, fds, self._batch, self._fds = self._batch, self._fds, [], []
        try:
            self._send({"jobs": batch}, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def wait(self, dst: int, end: int) -> None:
        """Block until no queued or running copy lands in `dst` below `end`; the first error raised."""
        if any(d == dst and a < end for d, a in self._pending):
            self.flush()
            self._pings += 1
            self._send({"ping": self._pings}, [])
            while self._error is None and self._pending:
                self._receive()
        self._raise()

    def finish(self) -> None:
        """Every queued copy written and synced, the child gone; the first error raised."""
        try:
            self.flush()
            if self._pid is not None and self._error is None:
                self._send({"end": True}, [])
                while self._error is None and not self._ended:
                    self._receive()
        finally:
            self._stop()
        self._raise()

    def cancel(self) -> None:
        """Drop what is queued and stop the copy under way: the child is killed (errors dropped)."""
        for fd in self._fds:
            os.close(fd)
        self._batch, self._fds = [], []
        self._stop()

    def _start(self) -> None:
        self._sock, self._pid = _spare.pop() if _spare else _fork()

    def _stop(self) -> None:
        """Kill and reap the child (once: a reaped pid may be another process's)."""
        if self._pid is not None:
            pid, self._pid = self._pid, None
            self._sock.close()
            kill_group(pid)

    def _send(self, message: dict, fds: list[int]) -> None:
        """A message to the child (the socket's buffer bounds the queue: a full one waits for the
        child); when the child has stopped (an error it answered), that error."""
        try:
            socket.send_fds(self._sock, [json.dumps(message).encode()], fds)
        except OSError:  # the child ended: its answer says why
            while self._error is None:
                self._receive()
            self._raise()

    def _receive(self) -> None:
        """One answer of the child: every job before a ping done, the end, or the error that stopped it."""
        data = self._sock.recv(MESSAGE)
        if not data:
            self._error = RuntimeError("the weights copier ended before its jobs did")
            return
        answer = json.loads(data)
        if answer.get("pong") == self._pings:
            self._pending.clear()
        elif "ended" in answer:
            self._ended = True
        elif "error" in answer:
            self._error = _error_of(answer["error"])

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


_spare: list[tuple[socket.socket, int]] = []  # a child forked ahead (`prestart`), for the next Copier


def prestart() -> None:
    """Fork the next Copier's child now, while this process holds no graph: a fork's resident pages
    count in its RSS, and those it touches become its own (forked after a 1.5B load: +103 MB of
    summed RSS, +41 MB of PSS). `discard` ends it if no Copier takes it."""
    if FORKS and not _spare:
        _spare.append(_fork())


def discard() -> None:
    """Kill and reap a child `prestart` made that no Copier took."""
    while _spare:
        sock, pid = _spare.pop()
        sock.close()
        kill_group(pid)


def _fork() -> tuple[socket.socket, int]:
    """A copier child serving the other end of a new socket pair; (this end, its pid)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def child() -> None:
        mine.close()
        _serve(theirs)

    try:
        return mine, fork(child)
    except OSError:
        mine.close()
        raise
    finally:
        theirs.close()


def _serve(sock: socket.socket) -> None:
    """The child: copy each job as it comes; answer a ping once every job before it is done (the
    child answers nothing else while the caller may not be reading: it never waits on its
    answers); sync what was written whenever no job comes for `DRY_SECONDS`; at the end sync all
    and say so. Stops at the first error, after answering it."""
    files: dict[int, int] = {}  # the caller's dst -> this process's descriptor of it
    unsynced: set[int] = set()
    while True:
        if unsynced and not select.select([sock], [], [], DRY_SECONDS)[0]:  # the queue ran dry: sync
            error = _sync([files[d] for d in sorted(unsynced)])
            unsynced.clear()
            if error is not None:
                return _answer(sock, {"error": _describe(error)})
            continue
        data, fds, _, _ = socket.recv_fds(sock, MESSAGE, BATCH)
        if not data:  # the caller is gone
            return None
        job = json.loads(data)
        if "ping" in job:
            _answer(sock, {"pong": job["ping"]})
            continue
        if job.get("end"):
            error = _sync([files[d] for d in sorted(unsynced)])
            return _answer(sock, {"error": _describe(error)} if error is not None else {"ended": True})
        for i, one in enumerate(job["jobs"]):
            if "new" in one:
                files[one["dst"]] = fds[one["new"]]
            error = _copy(fds[one["src"]], files[one["dst"]], one["offset"], one["nbytes"], one["at"], one["what"])
            if error is not None:
                for later in job["jobs"][i + 1:]:
                    os.close(fds[later["src"]])
                return _answer(sock, {"error": _describe(error)})
            unsynced.add(one["dst"])


def _answer(sock: socket.socket, answer: dict) -> None:
    sock.send(json.dumps(answer).encode())


def _copy(src: int, dst: int, offset: int, nbytes: int, at: int, what: str) -> BaseException | None:
    """One job (`src` closed after it); the error that stopped it, or None."""
    try:
        copy_range(src, dst, offset, nbytes, at)
    except (ExternalDataError, OSError) as exc:
        return copy_error(exc, what)
    finally:
        os.close(src)
    return None


def _sync(files) -> OSError | None:
    """The written files synced (a full disk may only say so here: kept as is, as the caller's own
    fsync would have raised it)."""
    try:
        for fd in files:
            getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
    except OSError as exc:
        return exc
    return None


def _describe(error: BaseException) -> dict:
    """An error of the child as JSON (`_error_of` makes it again in the caller)."""
    if isinstance(error, InputError):
        return {"input": str(error)}
    return {"errno": error.errno, "strerror": error.strerror, "filename": error.filename}


def _error_of(data: dict) -> BaseException:
    if "input" in data:
        return InputError(data["input"])
    return OSError(data["errno"], data["strerror"], data["filename"]) if data["filename"] is not None \
        else OSError(data["errno"], data["strerror"])


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
