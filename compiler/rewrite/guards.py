"""Fully-masked-row guards: Where nodes that only zero rows a finite additive mask never has.

    Where(IsNaN(P), 0, P)                 -> P      (SDPA exports, after Softmax)
    Where(Less(ReduceSum(·), 1), 0, O)    -> O      (rows with no visible key)

Shared by the attention pass (which drops them) and the mask pass (which drops them together
with the guards on its own mask).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from mtkc.ir.constants import is_scalar
from mtkc.ir.graph_utils import replace_uses


def guarded(node: gs.Node) -> gs.Tensor | None:
    """The data input of a row-guard Where, else None."""
    if node.op != "Where" or len(node.inputs) != 3 or not node.outputs:
        return None
    cond, zero, data = node.inputs
    if not is_scalar(zero, 0.0) or not cond.inputs:
        return None
    test = cond.inputs[0]
    nan_guard = test.op == "IsNaN" and test.inputs[0] is data
    empty_row = test.op == "Less" and bool(test.inputs[0].inputs) and test.inputs[0].inputs[0].op == "ReduceSum" \
        and is_scalar(test.inputs[1], 1.0)
    return data if nan_guard or empty_row else None


def row_guards(graph: gs.Graph) -> list[tuple[gs.Node, gs.Tensor]]:
    """(Where, data) for every row guard whose output is not a graph output."""
    return [(node, data) for node in graph.nodes
            if (data := guarded(node)) is not None and not any(o is node.outputs[0] for o in graph.outputs)]


def drop(graph: gs.Graph, guards: list[tuple[gs.Node, gs.Tensor]]) -> int:
    """Bypass each guard Where (its output becomes its data input)."""
    for node, data in guards:
        replace_uses(graph, node.outputs[0], data)
        node.outputs.clear()
    return len(guards)
