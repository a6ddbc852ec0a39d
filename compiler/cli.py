"""Command line: thin subcommands over the Python API. Data to stdout, messages to stderr."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import sys

from mtkc import __version__
from mtkc.display import EscapingFormatter, escape
from mtkc.errors import FULL_DISK, MtkcError
from mtkc.interrupts import installed
from mtkc.ir import copier

# name -> (module, one-line help). A module defines `add_parser(subparsers)`, whose parser sets
# `func=run(args)->int`; only the command being run is imported (`mtkc --help` loads none: no
# onnx, onnxruntime or numpy).
COMMANDS = {
    "check": ("mtkc.commands.check", "what compile will do for one SDK, and the NPU verdict of every node (writes nothing)"),
    "sdks": ("mtkc.commands.sdks", "list SDK versions, MDLA archs and default arch"),
    "ops": ("mtkc.commands.ops", "list the ops of an SDK's capability table"),
    "passes": ("mtkc.commands.passes", "list the rewrite passes (built-in, installed, plugins)"),
    "compile": ("mtkc.commands.compile", "rewrite a model for an SDK and write OUT/ (graph, weights, manifest)"),
    "verify": ("mtkc.commands.verify", "compare the compiled pipeline with the original model in onnxruntime"),
    "generate": ("mtkc.commands.generate", "greedy generation through compiled prefill/decode graphs (reference host runtime)"),
    "calibrate": ("mtkc.commands.calibrate", "store the inputs of every NPU partition on real prompts (quantisation calibration)"),
    "convert": ("mtkc.commands.convert", "convert OUT's NPU partitions with quantisation on (needs `mtkc calibrate OUT` first)"),
}

log = logging.getLogger("mtkc")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s subparser in full (its module imported) and the others as names."""
    parser = argparse.ArgumentParser(prog="mtkc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtkc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(_WithHelp(sub, text))
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


class _WithHelp:
    """The subparsers action, giving the command's parser its listing line from COMMANDS."""

    def __init__(self, sub, text: str):
        self.sub, self.text = sub, text

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.sub.add_parser(name, help=self.text, **kwargs)


GC_YOUNG = 100_000  # allocations between young collections (Python's default: 700)
GRAPH_COMMANDS = frozenset({"check", "compile"})  # no automatic collection while they run


@contextlib.contextmanager
def collector(command: str, restore: bool = True):
    """Fewer cyclic-GC sweeps while a command runs: a graph is hundreds of thousands of objects that
    live as long as the command, and with Python's default thresholds the collector traverses them
    again and again. check and compile, which hold little else, run without automatic collection
    (measured: 11 % of a 197k-node check, one full sweep alone 6.6 s; peak RSS 2.76 GB against
    2.74 GB there, 189 against 188 MB compiling 0.5B); the other commands, whose loops run for minutes,
    sweep the young generation every `GC_YOUNG` allocations (10-15 % of their CPU time at the
    default). The host's settings come back after, unless `restore` is False (the process ends: see
    `entry`)."""
    before, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(GC_YOUNG, *before[1:])
    if command in GRAPH_COMMANDS:
        gc.disable()
    try:
        yield
    finally:
        if restore:
            gc.set_threshold(*before)
            if enabled:
                gc.enable()


def entry() -> None:
    """The `mtkc` program (`python -m mtkc`, the console script): `main`, then the process ends
    without collecting what the command built. A graph is objects in reference cycles, which only
    the cyclic collector frees: after a check of 197k nodes (71 s) that took 3.1 s, for memory the
    OS takes back at once anyway."""
    code = main(ending=True)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed early: not an error (as in `main`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as exc:  # stdout on a full disk: the user's, not mtkc's
        print(f"mtkc: error: cannot write to stdout: {exc.strerror or exc}", file=sys.stderr)
        code = code or 2
    except ValueError:  # stdout closed by the command's host
        pass
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, ending: bool = False) -> int:
    """Run one command; its exit code. `ending`: the process ends right after (`entry`), so the
    collector settings are not put back."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "compile":  # its weights' copier, forked before the command's imports (17 MB, not 41)
        copier.prestart()
    try:
        return _run(build_parser(command), argv, ending)
    finally:
        copier.discard()  # when compile did not take it


def _run(parser: argparse.ArgumentParser, argv: list[str], ending: bool) -> int:
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
    try:
        with installed(), collector(args.command, restore=not ending):  # SIGTERM/Ctrl-C: staging removed, converters killed, within a second
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
        if isinstance(exc, OSError) and exc.errno in FULL_DISK:  # stdout on a full disk: the user's
            print(f"mtkc: error: cannot write: {escape(exc.strerror or exc)}", file=sys.stderr)
            return 2
        print(
            f"mtkc: internal error: {type(exc).__name__}: {escape(exc)}. This is a bug in mtkc; "
            "rerun with MTKC_TRACEBACK=1 and report the output.",
            file=sys.stderr,
        )
        if os.environ.get("MTKC_TRACEBACK"):
            raise
        return 4
