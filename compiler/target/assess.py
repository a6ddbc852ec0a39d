"""Verdicts for a whole graph: coverage, unsupported nodes grouped by reason, a linear partition estimate.

    assess(graph, table) -> Assessment

`mtkc check` shows it for the input (raw) and compile records it after the passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.errors import InputError
from mtkc.ir.toposort import toposort
from mtkc.target.capability import DEFAULT_DOMAIN, Table, Verdict


@dataclass
class Group:
    """Unsupported nodes sharing op, domain and reason (detail/remedy of the first one)."""

    op: str
    domain: str
    verdict: Verdict  # of the first node
    nodes: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return self.verdict.reason

    @property
    def count(self) -> int:
        return len(self.nodes)


@dataclass
class Assessment:
    nodes: int  # non-Constant nodes judged
    supported: int
    partition_sizes: list[int]  # maximal runs of NPU nodes in topological order
    groups: list[Group]
    constants: int = 0  # Constant nodes (data, not judged)

    @property
    def coverage(self) -> float:
        return round(self.supported / self.nodes, 4) if self.nodes else 1.0

    @property
    def partitions(self) -> int:
        return len(self.partition_sizes)

    def to_json(self) -> dict:
        """Every field, for another process (`from_json` gives an equal Assessment back)."""
        return {"nodes": self.nodes, "supported": self.supported, "partition_sizes": self.partition_sizes,
                "constants": self.constants,
                "groups": [{"op": g.op, "domain": g.domain, "nodes": g.nodes,
                            "verdict": {**{k: getattr(g.verdict, k) for k in _VERDICT_FIELDS},
                                        "known_passes": _sorted(g.verdict.known_passes)}} for g in self.groups]}

    @classmethod
    def from_json(cls, data: dict) -> Assessment:
        groups = []
        for g in data["groups"]:
            v = g["verdict"]
            known = v["known_passes"]
            verdict = Verdict(**{k: v[k] for k in _VERDICT_FIELDS if k != "passes"}, passes=tuple(v["passes"]),
                              known_passes=None if known is None else frozenset(known))
            groups.append(Group(g["op"], g["domain"], verdict, list(g["nodes"])))
        return cls(data["nodes"], data["supported"], list(data["partition_sizes"]), groups, data["constants"])


_VERDICT_FIELDS = ("supported", "target", "reason", "detail", "passes", "first_sdk", "hint")


def _sorted(names: frozenset[str] | None) -> list[str] | None:
    return None if names is None else sorted(names)


def assess(graph: gs.Graph, table: Table, opset: int | None = None,
           read_values: Callable[[gs.Constant], np.ndarray] | None = None) -> Assessment:
    """Verdicts for every node of a typed graph, grouped; partitions estimated (linear)."""
    try:
        toposort(graph)
    except Exception as exc:  # graphsurgeon raises a bare Exception on cycles
        raise InputError(f"graph '{graph.name}' is not a DAG ({exc})") from None
    groups: dict[tuple[str, str, str], Group] = {}
    sizes: list[int] = []
    run = supported = constants = 0
    for node in graph.nodes:
        if node.op == "Constant":
            constants += 1
            continue
        v: Verdict = table.verdict(node, opset, read_values)
        if v.supported:
            supported += 1
            run += 1
            continue
        if run:
            sizes.append(run)
            run = 0
        domain = node.domain or DEFAULT_DOMAIN
        key = (node.op, domain, v.reason)
        if key not in groups:
            groups[key] = Group(node.op, domain, v)
        groups[key].nodes.append(node.name)
    if run:
        sizes.append(run)
    ordered = sorted(groups.values(), key=lambda g: (-g.count, g.domain, g.op, g.reason))
    return Assessment(len(graph.nodes) - constants, supported, sizes, ordered, constants)
