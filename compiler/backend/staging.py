"""Write a folder atomically: build it in a sibling staging folder, then swap it into place.

    with staged(out, overwrite) as stage:     .OUT.mtkc-<pid>-xxxx/   every file is written here
        write(stage)                          (an exception, Ctrl-C: staging removed, OUT untouched)
    # leaving the block                       OUT is the new folder, or the previous one intact

The swap is one `renameat2(RENAME_EXCHANGE)` on Linux (OUT never missing, not even for an
instant); elsewhere two renames, putting the previous OUT back if the second fails. A process
killed with SIGKILL cannot clean up: its staging folder carries its pid and is removed by the
next run into the same parent once that pid is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mtkc.errors import InputError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@contextlib.contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging folder beside `out`; on normal exit it becomes `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    stage = Path(tempfile.mkdtemp(prefix=f"{_prefix(out)}{os.getpid()}-", dir=out.parent))
    try:
        yield stage
        if out.exists():
            if not overwrite:
                raise InputError(f"{out}: exists; pass --overwrite to replace it")
            _swap(stage, out)  # stage now holds the previous OUT, removed below
        else:
            os.rename(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _prefix(out: Path) -> str:
    return f".{out.name}.mtkc-"


def _remove_stale(out: Path) -> None:
    """Staging folders of `out` left by processes that no longer exist (killed mid-write)."""
    for path in out.parent.glob(f"{_prefix(out)}*"):
        pid = path.name[len(_prefix(out)):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _swap(stage: Path, out: Path) -> None:
    """Exchange `stage` and `out` atomically when the OS can, else rename twice."""
    if _exchange(stage, out):
        return
    old = Path(tempfile.mkdtemp(prefix=f"{_prefix(out)}{os.getpid()}-old-", dir=out.parent))
    try:
        os.rename(out, old / out.name)
        try:
            os.rename(stage, out)
        except BaseException:
            os.rename(old / out.name, out)  # put the previous output back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """`renameat2(a, b, RENAME_EXCHANGE)`; False when the libc or file system does not offer it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
