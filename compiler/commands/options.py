"""Option groups defined once and shared by check, compile, verify (Polygraphy-style)."""

from __future__ import annotations

import argparse

from mtkc.errors import InputError


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer messages on stderr")


def add_target(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--sdk", required=required, help="NeuroPilot SDK version (see `mtkc sdks`)")
    group.add_argument("--arch", help="MDLA arch; default: the SDK table's default")


def add_shapes(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shape binding")
    group.add_argument("--seq-len", type=int, help="bind the sequence-length dim")
    group.add_argument("--cache-len", type=int, help="bind the past/cache-length dim")
    group.add_argument("--batch", type=int, help="bind the batch dim (default 1 when other dims are bound)")
    group.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="bind one graph input's shape (repeatable)",
    )


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise InputError(f"--input-shape '{item}': expected NAME=D0,D1,... with integer dims") from None
    return shapes


def add_pipeline(parser: argparse.ArgumentParser) -> None:
    """Pass selection, plugins and the config file (see `mtkc passes`)."""
    group = parser.add_argument_group("passes")
    group.add_argument("--passes", metavar="A,B,...", help="run exactly these passes, in this order")
    group.add_argument("--skip-pass", action="append", default=[], metavar="PASS", help="drop a pass (repeatable)")
    group.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE.py|MODULE|NAME",
        help="load a plugin file or module, or enable an installed plugin pass (repeatable)",
    )
    group.add_argument("--config", metavar="FILE", help="mtkc.toml or pyproject.toml ([tool.mtkc]); default: ./mtkc.toml")


def split_names(text: str | None) -> list[str] | None:
    """'a, b,c' -> ['a', 'b', 'c']; None stays None."""
    if text is None:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]
