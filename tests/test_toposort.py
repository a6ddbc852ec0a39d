"""compiler.toposort: Kahn order and the node it names on a cycle (load checks and pass invariants)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from mtkc.errors import PassError
from mtkc.ir.toposort import cycle_node, kahn_order
from mtkc.manager.invariants import restore


def test_kahn_order_of_a_dag_with_a_repeated_edge():
    assert kahn_order([[1, 1, 2], [2], []]) == [0, 1, 2]
    assert cycle_node([[1, 1, 2], [2], []]) is None


def test_cycle_node_is_on_the_cycle_not_behind_it():
    # 0 -> 1 -> 2 -> 1 (cycle 1,2), 2 -> 3 (behind the cycle), 4 -> 3
    successors = [[1], [2], [1, 3], [], [3]]
    assert kahn_order(successors) == [0, 4]
    assert cycle_node(successors) == 1
    assert cycle_node([[0]]) == 0  # a self-loop


def test_pass_invariants_name_a_node_on_the_cycle():
    x = gs.Variable("x", np.float32, [2])
    t = {n: gs.Variable(n, np.float32, [2]) for n in ("a", "b", "c", "y")}
    nodes = [gs.Node("Relu", "behind", inputs=[t["b"]], outputs=[t["y"]]),  # first in the list, not on the cycle
             gs.Node("Add", "loop_add", inputs=[x, t["c"]], outputs=[t["b"]]),
             gs.Node("Relu", "loop_relu", inputs=[t["b"]], outputs=[t["c"]])]
    graph = gs.Graph(nodes, [x], [t["y"]], opset=17)
    with pytest.raises(PassError, match="pass 'p': the graph has a cycle through node 'loop_add'"):
        restore(graph, "p")
