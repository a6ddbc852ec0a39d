"""Topological order and cycle finding: the one implementation, for graphsurgeon graphs and for
nodes numbered 0..n-1 (the ONNX proto checks at load).

`successors[i]` lists the nodes that read an output of node i (an edge may repeat).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import detach, plain


class CycleError(Exception):
    """The graph has a cycle; `node` lies on it."""

    def __init__(self, node: gs.Node):
        super().__init__(f"the graph has a cycle through node '{node.name or node.op}'")
        self.node = node


def kahn_order(successors: Sequence[Sequence[int]]) -> list[int]:
    """The nodes in a topological order; a node on or behind a cycle is left out."""
    indegree = [0] * len(successors)
    for succ in successors:
        for j in succ:
            indegree[j] += 1
    ready = deque(i for i, d in enumerate(indegree) if d == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    return order


def cycle_node(successors: Sequence[Sequence[int]]) -> int | None:
    """A node that lies on a cycle, or None when there is none.

    Every node Kahn leaves out has a left-out predecessor, so walking back from the first one
    (always to the lowest-numbered such predecessor) repeats a node, which is on a cycle.
    """
    left = set(range(len(successors))) - set(kahn_order(successors))
    if not left:
        return None
    preds: dict[int, list[int]] = {i: [] for i in left}
    for p in left:
        for j in successors[p]:
            if j in left:
                preds[j].append(p)
    i, seen = min(left), set()
    while i not in seen:
        seen.add(i)
        i = min(preds[i])
    return i


def successors(graph: gs.Graph) -> list[list[int]]:
    """`successors[i]`: indices of the nodes of `graph` reading an output of node i."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    succ: list[list[int]] = [[] for _ in graph.nodes]
    for i, node in enumerate(graph.nodes):
        for t in node.inputs:
            for p in t.inputs:
                if id(p) in index:
                    succ[index[id(p)]].append(i)
    return succ


def topo_order(graph: gs.Graph) -> list[gs.Node]:
    """The node order graphsurgeon's `Graph.toposort()` gives (depth from the inputs, ties in its
    first-visit order), in linear time; the graph is not changed. Producers outside `graph.nodes`
    are ignored. Raises CycleError naming a node on a cycle."""
    members = {id(n) for n in graph.nodes}
    level = _sorted_levels(graph.nodes, members)
    if level is not None:  # already in an order: the walk below would visit the nodes in it
        return sorted(graph.nodes, key=lambda n: level[id(n)])

    def producers(node: gs.Node):
        for t in node.inputs:
            for p in t.inputs:
                if id(p) in members:
                    yield p

    level: dict[int, int] = {}
    visited: list[gs.Node] = []  # post-order: graphsurgeon's insertion order
    for root in graph.nodes:
        if id(root) in level:
            continue
        stack = [(root, producers(root), [-1])]
        on_path = {id(root)}
        while stack:
            node, pending, deepest = stack[-1]
            for p in pending:
                if id(p) in level:
                    deepest[0] = max(deepest[0], level[id(p)])
                    continue
                if id(p) in on_path:
                    raise CycleError(graph.nodes[cycle_node(successors(graph))])
                on_path.add(id(p))
                stack.append((p, producers(p), [-1]))
                break
            else:
                stack.pop()
                on_path.discard(id(node))
                level[id(node)] = deepest[0] + 1
                visited.append(node)
                if stack:
                    parent = stack[-1][2]
                    parent[0] = max(parent[0], level[id(node)])
    return sorted(visited, key=lambda n: level[id(n)])


def _sorted_levels(nodes: list[gs.Node], members: set[int]) -> dict[int, int] | None:
    """Depth of every node when each one's producers come before it in `nodes`, else None.

    Then `topo_order`'s walk from each node in turn finds every producer already visited, so it
    visits the nodes in this order: one forward sweep gives the same depths."""
    level: dict[int, int] = {}
    for node in nodes:
        deepest = -1
        for t in node.inputs:
            for p in t.inputs:
                d = level.get(id(p))
                if d is None:
                    if id(p) in members:
                        return None
                elif d > deepest:
                    deepest = d
        level[id(node)] = deepest + 1
    return level if len(level) == len(nodes) else None  # a node listed twice: the walk lists it once


def live_nodes(graph: gs.Graph) -> tuple[list[gs.Node], set[int]]:
    """The nodes a graph output depends on, in list order, and the ids of every producer met on the
    way (cleanup's walk, backwards over the list: a node is live when a graph output or a live node
    reads it). Graph inputs lose their producers first, as in cleanup."""
    for t in graph.inputs:
        t.inputs.clear()
    used = {id(p) for t in graph.outputs for p in t.inputs}  # a producer outside the list is never visited
    add = used.add
    live: list[gs.Node] = []
    for node in reversed(graph.nodes):
        if id(node) in used:
            live.append(node)
            for t in node.inputs:
                for p in t.inputs:
                    add(id(p))
    live.reverse()
    return live, used


def keep_sorted(graph: gs.Graph, live: list[gs.Node], used: set[int], depths: list[int]) -> None:
    """`live_nodes`' result made the graph's node list: the others detached, the live ones by
    `depths` (theirs, in list order; ties keep the list's order, as `topo_order` sorts)."""
    if len(live) != len(graph.nodes):
        detach([n for n in graph.nodes if id(n) not in used])
    if any(a > b for a, b in zip(depths, depths[1:])):
        live = [live[i] for i in sorted(range(len(live)), key=depths.__getitem__)]
    graph.nodes = live


def toposort(graph: gs.Graph, simple: bool | None = None) -> gs.Graph:
    """Sort `graph.nodes` topologically (graphsurgeon's own sort for graphs with subgraphs/functions;
    `simple`: `plain(graph)`, when the caller knows it)."""
    if not (plain(graph) if simple is None else simple):
        if (i := cycle_node(successors(graph))) is not None:
            raise CycleError(graph.nodes[i])
        return graph.toposort()
    graph.nodes = topo_order(graph)
    return graph
