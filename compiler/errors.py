"""Errors users can act on. Each carries the process exit code the CLI returns for it."""

import errno

FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})  # a write's disk: the user's


class MtkcError(Exception):
    """Base class: a one-line message naming the file/tensor/node, and an exit code."""

    exit_code = 2


class InputError(MtkcError):
    """Bad input or usage: malformed model, hostile external data, unknown SDK, bad option."""

    exit_code = 2


class PassError(MtkcError):
    """A pass (built-in or plugin) failed or broke a graph invariant; names the pass."""

    exit_code = 2


class InternalError(MtkcError):
    """mtkc's own checks caught a bug in mtkc (a built-in pass broke the graph): exit 4, named."""

    exit_code = 4


class MismatchError(MtkcError):
    """Numerical verification failed (verify, --verify-each)."""

    exit_code = 1


class ConverterError(MtkcError):
    """MediaTek's converter (or the user's converter command) failed."""

    exit_code = 3


class ExternalDataError(Exception):
    """Why one external-data location is refused (the caller adds file and tensor)."""
