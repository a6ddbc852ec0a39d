"""Command line: thin subcommands over the Python API. Data to stdout, messages to stderr."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from mtkc import __version__
from mtkc.backend.staging import interrupts_unwind
from mtkc.display import EscapingFormatter, escape
from mtkc.errors import MtkcError

# Each module defines `add_parser(subparsers)`; the parser it adds sets `func=run(args)->int`.
COMMANDS = [
    "mtkc.commands.check",
    "mtkc.commands.sdks",
    "mtkc.commands.ops",
    "mtkc.commands.passes",
    "mtkc.commands.compile",
    "mtkc.commands.verify",
    "mtkc.commands.generate",
    "mtkc.commands.calibrate",
    "mtkc.commands.convert",
]

log = logging.getLogger("mtkc")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtkc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtkc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    verbosity = getattr(args, "verbose", 0) - getattr(args, "quiet", 0)
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(message)s"))  # names from the model: one line, no escapes
    log.handlers[:] = [handler]  # mtkc's messages go here whatever logging a host (pytest, an app) set up;
    log.setLevel(level)  # they still propagate to the host's handlers (capture), none of which print
    interrupts_unwind()  # SIGTERM/Ctrl-C: staging removed, converters killed
    try:
        return args.func(args)
    except MtkcError as exc:
        print(f"mtkc: error: {escape(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("mtkc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`mtkc passes | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug: one line, and how to report it
        print(
            f"mtkc: internal error: {type(exc).__name__}: {escape(exc)}. This is a bug in mtkc; "
            "rerun with MTKC_TRACEBACK=1 and report the output.",
            file=sys.stderr,
        )
        if os.environ.get("MTKC_TRACEBACK"):
            raise
        return 4
