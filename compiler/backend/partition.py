"""Place every node on NPU or CPU, then group the graph into convex partitions.

Grouping follows ONNX Runtime's topological "wave" algorithm (`partitioning_utils.cc`): a Kahn
sort that keeps adding ready NPU nodes to the open group; a ready CPU node that consumes the open
group's output is deferred to the next wave, any other CPU node runs now, *before* the group
(it does not depend on it). When nothing is ready the wave closes:

    wave k:   [CPU nodes independent of group k] -> [NPU group k]
    wave k+1: [deferred CPU nodes + ...]         -> [NPU group k+1] ...

Every edge goes forward in that sequence, so each segment is convex (no path leaves it and comes
back) and the partition graph is acyclic; segments are in execution order. O(V + E),
deterministic (ready queue seeded and fed in graph order).
"""

from __future__ import annotations

import fnmatch
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import onnx_graphsurgeon as gs

from mtkc.errors import InputError

NPU, CPU = "npu", "cpu"


@dataclass(frozen=True)
class Placement:
    """Where one node runs; CPU placements say why (stable reason code + detail)."""

    target: str
    reason: str = ""
    detail: str = ""
    remedy: str = ""
    forced: bool = False


@dataclass
class Partition:
    id: str
    target: str
    nodes: list[gs.Node] = field(default_factory=list)


@dataclass(frozen=True)
class Pattern:
    """A `--force-cpu/--force-npu` pattern: `op:TYPE` (exact op type) or `node:GLOB` (node name)."""

    kind: str
    value: str

    @classmethod
    def parse(cls, text: str, option: str) -> "Pattern":
        kind, sep, value = text.partition(":")
        if not sep or kind not in ("op", "node") or not value:
            raise InputError(f"{option} '{text}': expected op:TYPE or node:GLOB")
        return cls(kind, value)

    def matches(self, node: gs.Node) -> bool:
        if self.kind == "op":
            return node.op == self.value
        return fnmatch.fnmatchcase(node.name or "", self.value)

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


def parse_patterns(items: Iterable[str] | None, option: str) -> list[Pattern]:
    return [Pattern.parse(item, option) for item in items or ()]


def place(
    graph: gs.Graph,
    verdict: Callable[[gs.Node], object],
    force_cpu: Sequence[Pattern] = (),
    force_npu: Sequence[Pattern] = (),
) -> dict[str, Placement]:
    """Placement per node name from the table's verdicts and the user's overrides.

    `verdict(node)` returns an object with `supported`, `reason`, `detail` (capability.Verdict).
    `force_npu` wins over `force_cpu` and the minimum partition size, but forcing a node the
    table rejects is an InputError naming the node and the table's reason.
    """
    placements: dict[str, Placement] = {}
    for node in graph.nodes:
        v = verdict(node)
        npu_pattern = next((p for p in force_npu if p.matches(node)), None)
        cpu_pattern = next((p for p in force_cpu if p.matches(node)), None)
        if npu_pattern is not None:
            if not v.supported:
                raise InputError(
                    f"--force-npu {npu_pattern}: node '{node.name}' ({node.op}) is not supported "
                    f"on the NPU: {v.reason}{': ' + v.detail if v.detail else ''}"
                )
            placements[node.name] = Placement(NPU, forced=True)
        elif cpu_pattern is not None:
            placements[node.name] = Placement(CPU, "forced-cpu", f"--force-cpu {cpu_pattern}", "drop the --force-cpu pattern", forced=True)
        elif v.supported:
            placements[node.name] = Placement(NPU)
        else:
            placements[node.name] = Placement(CPU, v.reason or "unsupported", getattr(v, "detail", None) or "",
                                              getattr(v, "remedy", None) or "")
    return placements


def unmatched(graph: gs.Graph, patterns: Sequence[Pattern]) -> list[Pattern]:
    """Patterns that match no node of `graph` (likely typos; the caller warns)."""
    return [p for p in patterns if not any(p.matches(n) for n in graph.nodes)]


def name_nodes(graph: gs.Graph) -> None:
    """Make node names non-empty and unique, deterministically (`<op>_<k>`, `<name>_<k>`).

    Placements are keyed by node name, and Model Explorer drops unnamed nodes.
    """
    taken = {n.name for n in graph.nodes if n.name}
    seen: set[str] = set()
    counter = 0
    for node in graph.nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        base = node.name or node.op
        while f"{base}_{counter}" in taken:
            counter += 1
        node.name = f"{base}_{counter}"
        taken.add(node.name)
        seen.add(node.name)


def node_inputs(node: gs.Node) -> list[gs.Tensor]:
    """The tensors a node reads: its inputs plus outer-scope tensors its subgraphs (If/Loop) use."""
    subs = list(node.subgraphs(recursive=True))
    if not subs:
        return list(node.inputs)
    local = {id(t) for g in subs for t in g.inputs} | {id(t) for g in subs for n in g.nodes for t in n.outputs}
    used = [t for g in subs for n in g.nodes for t in n.inputs] + [t for g in subs for t in g.outputs]
    return list(node.inputs) + [t for t in used if id(t) not in local]


def partition(
    graph: gs.Graph,
    placements: dict[str, Placement],
    min_partition_nodes: int = 1,
) -> tuple[list[Partition], dict[str, Placement]]:
    """Convex NPU/CPU partitions in execution order, and the final placements.

    NPU groups smaller than `min_partition_nodes` (not forced) move to CPU with reason
    `partition-too-small`; grouping then runs once more so the CPU islands merge, and any group
    still too small is relabelled CPU in place (still convex: segments stay contiguous).
    """
    nodes = list(graph.nodes)
    succ, indeg, in_order = _edges(nodes)
    placements = dict(placements)
    segments = _waves(nodes, succ, indeg, placements)
    if min_partition_nodes > 1:
        small = _too_small(nodes, segments, placements, min_partition_nodes)
        if small:
            placements.update(small)
            segments = _waves(nodes, succ, indeg, placements)
            small = _too_small(nodes, segments, placements, min_partition_nodes)
            placements.update(small)
            segments = [(CPU if t == NPU and any(nodes[i].name in small for i in idx) else t, idx) for t, idx in segments]
    merged: list[tuple[str, list[int]]] = []
    for target, idx in segments:
        if not idx:
            continue
        if merged and merged[-1][0] == target:
            merged[-1][1].extend(idx)
        else:
            merged.append((target, list(idx)))
    parts = [Partition(f"{target}{k}", target) for k, (target, _) in enumerate(merged)]
    if in_order:  # graph order reads best; a convex subset of a topological order is topologically sorted
        owner = [0] * len(nodes)
        for k, (_, idx) in enumerate(merged):
            for i in idx:
                owner[i] = k
        for i, node in enumerate(nodes):
            parts[owner[i]].nodes.append(node)
    else:  # the order the waves took them in is topological too
        for part, (_, idx) in zip(parts, merged):
            part.nodes.extend(nodes[i] for i in idx)
    return parts, placements


def _edges(nodes: list[gs.Node]) -> tuple[list[list[int]], list[int], bool]:
    """Successor lists, in-degrees, and whether the node list is already topologically sorted."""
    index = {id(n): i for i, n in enumerate(nodes)}
    succ: list[list[int]] = [[] for _ in nodes]
    indeg = [0] * len(nodes)
    in_order = True
    for j, node in enumerate(nodes):
        for tensor in node_inputs(node):
            if tensor.inputs and id(tensor.inputs[0]) in index:
                i = index[id(tensor.inputs[0])]
                succ[i].append(j)
                indeg[j] += 1
                in_order = in_order and i < j
    return succ, indeg, in_order


def _waves(
    nodes: list[gs.Node], succ: list[list[int]], indeg0: list[int], placements: dict[str, Placement]
) -> list[tuple[str, list[int]]]:
    on_npu = [placements[n.name].target == NPU for n in nodes]
    indeg = list(indeg0)
    border = [-1] * len(nodes)  # wave number in which the node became a consumer of the open group
    ready = deque(i for i, d in enumerate(indeg) if d == 0)
    deferred: list[int] = []
    segments: list[tuple[str, list[int]]] = []
    wave, cpu_now, group = 0, [], []
    processed = 0
    while ready or deferred:
        if not ready:
            segments += [(CPU, cpu_now), (NPU, group)]
            wave, cpu_now, group = wave + 1, [], []
            ready.extend(deferred)
            deferred = []
            continue
        i = ready.popleft()
        if on_npu[i]:
            group.append(i)
            for s in succ[i]:
                border[s] = wave
        elif border[i] == wave:
            deferred.append(i)
            continue
        else:
            cpu_now.append(i)
        processed += 1
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    segments += [(CPU, cpu_now), (NPU, group)]
    if processed != len(nodes):
        raise InputError("graph has a cycle: cannot partition (nodes not topologically sortable)")
    return segments


def _too_small(
    nodes: list[gs.Node], segments: list[tuple[str, list[int]]], placements: dict[str, Placement], minimum: int
) -> dict[str, Placement]:
    small: dict[str, Placement] = {}
    for target, idx in segments:
        if target != NPU or not idx or len(idx) >= minimum:
            continue
        if any(placements[nodes[i].name].forced for i in idx):
            continue
        detail = f"NPU island of {len(idx)} node(s) < --min-partition-nodes {minimum}"
        remedy = "lower --min-partition-nodes, or --force-npu the nodes"
        small.update({nodes[i].name: Placement(CPU, "partition-too-small", detail, remedy) for i in idx})
    return small


def coverage(placements: dict[str, Placement]) -> float:
    """Fraction of nodes placed on the NPU (1.0 for an empty graph)."""
    if not placements:
        return 1.0
    return sum(p.target == NPU for p in placements.values()) / len(placements)
