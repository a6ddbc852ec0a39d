"""builder.Emit: fresh names from one graph_utils.Names per graph, shared by every Emit on it."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.rewrite.builder import Emit


def test_emit_names_are_unique_deterministic_and_shared_per_graph():
    x = gs.Variable("x", np.float32, [2])
    taken = gs.Constant("site/mtkc_mul_out", np.ones(2, np.float32))  # an initializer already has the name
    y = gs.Variable("y", np.float32, [2])
    graph = gs.Graph([gs.Node("Add", "site", inputs=[x, taken], outputs=[y])], [x], [y], opset=17)
    first = Emit(graph, "site").Mul(x, x)
    second = Emit(graph, "site").Mul(first, x)  # a second Emit on the same graph
    assert [n.name for n in graph.nodes[1:]] == ["site/mtkc_mul", "site/mtkc_mul/1"]
    assert [first.name, second.name] == ["site/mtkc_mul_out/1", "site/mtkc_mul_out/2"]
    assert Emit(graph, "").name("scale") == "mtkc/mtkc_scale" and first.dtype == np.float32
