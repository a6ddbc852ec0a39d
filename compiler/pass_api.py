"""The Pass API: what a rewrite pass is, and the context it runs in.

A pass has a unique kebab-case `name`, a one-line `description`, `applies(ctx)` (SDK, options)
and `run(graph, ctx) -> PassResult`. Register built-ins and plugins with `@register`.
Rewrites report the sites that did not match (`PassResult.misses`) with the first failing
condition, so `mtkc compile --explain PASS` can say why without reading code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx_graphsurgeon as gs

NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass
class Miss:
    """A candidate site a rewrite looked at and refused, with the first failing condition."""

    node: str
    reason: str


@dataclass
class PassResult:
    rewrites: int = 0
    misses: list[Miss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.rewrites > 0


@dataclass
class Context:
    """What a pass may consult: the target table, user options, and how to read a weight."""

    table: Any  # mtkc.capability.Table
    options: dict[str, Any] = field(default_factory=dict)
    root: Path | None = None  # folder of the source model's external data
    read_values: Callable[[gs.Constant], Any] | None = None

    @property
    def sdk(self) -> str:
        return self.table.version


class Pass:
    """Base class for rewrite passes. Subclasses set `name`, `description`, implement `run`."""

    name: str = ""
    description: str = ""
    origin: str = "built-in"

    def applies(self, ctx: Context) -> bool:
        return True

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        raise NotImplementedError


REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator adding a pass to the registry (name must be unique and kebab-case)."""
    if not NAME_RE.match(cls.name or ""):
        raise ValueError(f"pass name '{cls.name}' is not kebab-case")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"pass name '{cls.name}' is already registered")
    REGISTRY[cls.name] = cls
    return cls
