"""Write a folder atomically: build it in a sibling staging folder, then swap it into place.

    with staged(out, overwrite) as stage:     .OUT.mtkc-<pid>-xxxx/   every file is written here
        write(stage)                          (an exception, Ctrl-C: staging removed, OUT untouched)
    # leaving the block                       OUT is the new folder, or the previous one intact

The swap is one `renameat2(RENAME_EXCHANGE)` on Linux (OUT never missing, not even for an
instant); elsewhere two renames, putting the previous OUT back if the second fails. A process
killed with SIGKILL cannot clean up: its staging folder carries its pid and is removed by the
next run into the same parent once that pid is gone (whatever OUT it was for). The folder gets the
umask's normal mode, not mkdtemp's 0700.

Only a folder mtkc wrote is ever replaced (`check_target`): its manifest.json has mtkc's keys
and every file in it is one its own records list (`mtkc.backend.owned`); anything else is an
InputError naming the file, so `--overwrite` can never delete a file of the user's. The user's disk (read-only, full, `-o`
under a file) is an InputError too, never a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from mtkc.backend.owned import foreign_file, out_files, stale, staging_prefix
from mtkc.errors import InputError
from mtkc.interrupts import STAGES

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
MARK = "mtkc"  # manifest key (mtkc's version) that, with schema_version, marks a folder mtkc wrote
REMEDY = "--overwrite only replaces mtkc output, choose another -o"
# errno values that describe the user's disk or path, not a bug: an InputError naming OUT.
_DISK_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                errno.EEXIST, errno.ENAMETOOLONG, errno.EISDIR, errno.EFBIG, errno.EMLINK, errno.ELOOP,
                errno.ENOENT, errno.EXDEV, errno.EBUSY}


@contextlib.contextmanager
def staged(out: Path, overwrite: bool, foreign: Callable[[Path], str | None] | None = None,
           remedy: str = REMEDY) -> Iterator[Path]:
    """Yield an empty staging folder beside `out`; on normal exit it becomes `out`. `foreign(out)`
    says why an existing `out` is not mtkc's to replace (default: `foreign_entry`, a compile's OUT)."""
    stage = Stage(out, overwrite, foreign, remedy)
    try:
        with disk_errors(stage.given):
            yield stage.path
        stage.publish()
    finally:
        stage.discard()


class Stage:
    """`staged` in steps, for a caller that writes between steps of its own: `publish` makes the
    folder OUT, `discard` (always call it) removes what was not published. Only the steps' own
    OSErrors name OUT (`disk_errors`); the caller wraps its writes."""

    def __init__(self, out: Path, overwrite: bool, foreign: Callable[[Path], str | None] | None = None,
                 remedy: str = REMEDY):
        self.given, self.out = out, Path(os.path.abspath(out))  # `-o .`: a name to stage beside
        self.overwrite, self.foreign, self.remedy = overwrite, foreign, remedy
        check_target(self.out, overwrite, out, foreign, remedy)
        with disk_errors(out):
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(self.out.parent)
            self.path = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(self.out)}{os.getpid()}-", dir=self.out.parent))
            self.path.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would make OUT unreadable to anyone else
        STAGES.add(self.path)

    def publish(self) -> None:
        """The staging folder becomes OUT (the previous OUT, if any, is removed by `discard`)."""
        with disk_errors(self.given):
            check_target(self.out, self.overwrite, self.given, self.foreign, self.remedy)  # it may have appeared meanwhile
            if os.path.lexists(self.out):
                _swap(self.path, self.out)  # the staging path now holds the previous OUT
            else:
                os.rename(self.path, self.out)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        STAGES.discard(self.path)


def check_target(out: Path, overwrite: bool, given: object = None,
                 foreign: Callable[[Path], str | None] | None = None, remedy: str = REMEDY) -> None:
    """OUT may be written: absent, or (with `overwrite`) a folder mtkc wrote. Else InputError."""
    shown = given if given is not None else out
    out = Path(os.path.abspath(out))
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise InputError(f"{shown}: exists and is not a folder")
    if not overwrite:
        raise InputError(f"{shown}: exists; pass --overwrite to replace it")
    why = (foreign or foreign_entry)(out)
    if why is not None:
        raise InputError(f"{shown}: not a folder mtkc wrote ({why}); {remedy}")


def foreign_entry(out: Path) -> str | None:
    """Why `out` is not an mtkc output folder (the first entry mtkc would not have written), or None."""
    if not any(not stale(p) for p in out.iterdir()):
        return None  # empty, or only a killed run's staging: nothing to lose
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "no readable manifest.json"
    if not isinstance(manifest, dict) or "schema_version" not in manifest or MARK not in manifest:
        return "manifest.json is not mtkc's"
    return foreign_file(out, out_files(out, manifest))


@contextlib.contextmanager
def disk_errors(out: object) -> Iterator[None]:
    """An OSError of the user's file system (read-only, full, not a folder...) -> InputError naming `out`."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS:
            raise
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out) else ""
        raise InputError(f"{out}: cannot write the output folder: {exc.strerror or exc}{where}") from None


def remove_stale(folder: Path) -> None:
    """Staging left in `folder` by mtkc processes of this user that no longer exist (killed mid-write)."""
    for path in folder.glob(".*.mtkc-*"):
        if stale(path):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()


def replace_file(path: Path, text: str) -> None:
    """Write `path` in one rename (readers see the old or the new file), through a staging name
    that `remove_stale` recognises if this process is killed before the rename."""
    tmp = path.with_name(f"{staging_prefix(path)}{os.getpid()}-tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _swap(stage: Path, out: Path) -> None:
    """Exchange `stage` and `out` atomically when the OS can, else rename twice."""
    if _exchange(stage, out):
        return
    old = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(out)}{os.getpid()}-old-", dir=out.parent))
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
