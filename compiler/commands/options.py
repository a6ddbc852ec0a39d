"""Option groups defined once and shared by check, compile, verify (Polygraphy-style)."""

from __future__ import annotations

import argparse

from mtkc.errors import InputError


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer messages on stderr")


def add_target(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--sdk", required=True, help="NeuroPilot SDK version (see `mtkc sdks`)")
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
