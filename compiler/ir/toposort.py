"""Kahn's algorithm over nodes numbered 0..n-1: the cycle checks at load and after every pass.

`successors[i]` lists the nodes that read an output of node i (an edge may repeat).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


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
