"""Calling code the user supplied (a pass, a plugin module): its failure is a PassError naming it.

With `-v` (DEBUG logging) the message also says where it raised (`file:line`), so a plugin
author can find the line without a traceback.
"""

from __future__ import annotations

import logging
import traceback

from mtkc.errors import MtkcError, PassError
from mtkc.rewrite.pass_api import describe

log = logging.getLogger("mtkc")


def guarded(p, what: str, fn, *args):
    """Call a pass hook; anything but an MtkcError becomes a PassError naming the pass."""
    try:
        return fn(*args)
    except MtkcError:
        raise
    except (Exception, SystemExit) as exc:  # sys.exit() in a pass is its failure, not mtkc's exit
        name = getattr(p, "name", "?")
        raise PassError(f"pass '{name}' ({describe(p if isinstance(p, type) else type(p))}) raised in {what}: "
                        f"{one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, and with -v ` (at file:line)` of the innermost frame."""
    text = str(exc).strip().splitlines()
    where = ""
    if log.isEnabledFor(logging.DEBUG) and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" (at {frame.filename}:{frame.lineno})"
    return (f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__) + where
