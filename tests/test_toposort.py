"""compiler.toposort: Kahn order, graphsurgeon's order and the node it names on a cycle; the graph_utils
helpers that keep graphsurgeon's tensor links (load checks and pass invariants)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtkc.errors import InternalError, PassError
from mtkc.ir import graph_utils as gu
from mtkc.ir.toposort import cycle_node, kahn_order, topo_order
from mtkc.manager.invariants import Sweep, restore


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


def _random_dag(seed: int, n: int = 60) -> gs.Graph:
    """Nodes reading up to three earlier tensors (some twice), listed in a shuffled order."""
    rng = np.random.default_rng(seed)
    x = gs.Variable("x", np.float32, [2])
    tensors, nodes = [x], []
    for i in range(n):
        reads = [tensors[j] for j in rng.integers(0, len(tensors), size=int(rng.integers(1, 4)))]
        out = gs.Variable(f"t{i}", np.float32, [2])
        nodes.append(gs.Node("Sum", f"n{i}", inputs=reads, outputs=[out]))
        tensors.append(out)
    order = rng.permutation(n)
    return gs.Graph([nodes[i] for i in order], [x], tensors[-3:], opset=17)


@pytest.mark.parametrize("seed", range(6))
def test_topo_order_is_graphsurgeons_order_shuffled_or_sorted(seed):
    graph = _random_dag(seed)
    for _ in range(2):  # shuffled (the walk), then in some topological order (one forward sweep)
        expected = [n.name for n in graph.copy().toposort().nodes]
        order = topo_order(graph)
        assert [n.name for n in order] == expected
        graph.nodes = _another_topological_order(order, np.random.default_rng(seed))


def _another_topological_order(order: list[gs.Node], rng) -> list[gs.Node]:
    """Kahn's order with ready nodes taken at random: topological, usually not graphsurgeon's."""
    index = {id(n): i for i, n in enumerate(order)}
    succ = [[] for _ in order]
    indegree = [0] * len(order)
    for i, node in enumerate(order):
        for t in node.inputs:
            for p in t.inputs:
                succ[index[id(p)]].append(i)
                indegree[i] += 1
    ready, out = [i for i, d in enumerate(indegree) if d == 0], []
    while ready:
        i = ready.pop(int(rng.integers(0, len(ready))))
        out.append(order[i])
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    assert len(out) == len(order)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_restore_is_graphsurgeons_cleanup_then_toposort(seed):
    """Live nodes in an order (a dead node may read a tensor made after it): the two sweeps (a
    `Sweep` back) leave the nodes, their order and every tensor's links as graphsurgeon's
    `cleanup().toposort()` does. Shuffled: the full cleanup and sort (None back), the same again."""
    def links(graph):
        tensors = {t.name: t for n in graph.nodes for t in (*n.inputs, *n.outputs)}
        return ([n.name for n in graph.nodes], [([t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes],
                {k: ([p.name for p in t.inputs], [c.name for c in t.outputs]) for k, t in sorted(tensors.items())})

    def build(order_seed: int | None):
        graph = _random_dag(seed)  # outputs: the last three tensors, so some nodes are dead
        if order_seed is not None:
            graph.nodes = _another_topological_order(topo_order(graph), np.random.default_rng(order_seed))
            late = graph.nodes[-1].outputs[0]
            graph.nodes.insert(0, gs.Node("Relu", "dead_early", inputs=[late], outputs=[gs.Variable("d", np.float32, [2])]))
        return graph

    for order_seed in (None, seed, seed + 100):
        theirs, mine = build(order_seed), build(order_seed)
        assert isinstance(restore(mine), Sweep) == (order_seed is not None)
        assert links(mine) == links(theirs.cleanup().toposort())
        assert "dead_early" not in links(mine)[0] and len(mine.nodes) < 60


def test_detach_clear_inputs_and_set_input_keep_graphsurgeons_links():
    """Unhooking by identity leaves every tensor's readers/producers as graphsurgeon's own
    `clear()` and `inputs[i] = t` do (same lists, same order); a node reading a tensor twice too."""
    def build():
        x = gs.Variable("x", np.float32, [2])
        c = gs.Constant("c", np.ones(2, np.float32))
        outs = [gs.Variable(f"y{i}", np.float32, [2]) for i in range(5)]
        nodes = [gs.Node("Add", f"n{i}", inputs=[x, c] if i % 2 else [c, c], outputs=[outs[i]]) for i in range(5)]
        return x, c, nodes

    def links(x, c, nodes):
        return ([n.name for n in x.outputs], [n.name for n in c.outputs],
                [([t.name for t in n.inputs], [t.name for t in n.outputs]) for n in nodes],
                [[p.name for p in n.outputs[0].inputs] if n.outputs else None for n in nodes])

    theirs, mine = build(), build()
    for n in (theirs[2][3], theirs[2][0]):
        n.inputs.clear()
        n.outputs.clear()
    gu.detach([mine[2][3], mine[2][0]])
    assert links(*mine) == links(*theirs)
    theirs[2][1].inputs.clear()
    gu.clear_inputs(mine[2][1])
    assert links(*mine) == links(*theirs)
    theirs, mine = build(), build()
    z = [gs.Variable("z", np.float32, [2]) for _ in range(2)]
    theirs[2][2].inputs[1] = z[0]
    theirs[2][4].inputs[0] = z[0]
    gu.set_input(mine[2][2], 1, z[1])
    gu.set_input(mine[2][4], 0, z[1])
    assert links(*mine) == links(*theirs)
    assert [n.name for n in z[1].outputs] == [n.name for n in z[0].outputs] == ["n2", "n4"]


def test_cleanup_drops_unused_inputs_as_graphsurgeon():
    def build():
        a, b, y = gs.Variable("a", np.float32, [2]), gs.Variable("b", np.float32, [2]), gs.Variable("y", np.float32, [2])
        dead = gs.Variable("d", np.float32, [2])
        nodes = [gs.Node("Relu", "dead", inputs=[b], outputs=[dead]), gs.Node("Relu", "live", inputs=[a], outputs=[y])]
        return gs.Graph(nodes, [a, b], [y], opset=17)

    theirs, mine = build().cleanup(remove_unused_graph_inputs=True), gu.cleanup(build(), unused_inputs=True)
    assert [t.name for t in mine.inputs] == [t.name for t in theirs.inputs] == ["a"]
    assert [n.name for n in mine.nodes] == [n.name for n in theirs.nodes] == ["live"]
    assert [t.name for t in gu.cleanup(build()).inputs] == ["a", "b"]


@pytest.mark.parametrize("seed", range(4))
def test_loose_tensors_sees_every_named_variable_the_graph_mentions(seed):
    """The loose sets (`invariants.loose_tensors`, which looks at node inputs only where they have no
    producer) are those of every named variable among the graph inputs, node inputs and outputs and
    graph outputs: here with untyped and symbolic tensors, a constant, a dangling input, a tensor
    whose producer left the graph, and one name two tensors share."""
    from mtkc.manager.invariants import check, loose_tensors

    rng = np.random.default_rng(seed)
    graph = _random_dag(seed)
    for t in [*graph.inputs, *(o for n in graph.nodes for o in n.outputs)]:
        t.dtype = None if rng.random() < 0.3 else t.dtype
        t.shape = ["s", 2] if rng.random() < 0.3 else t.shape
    dangling = gs.Variable("dangling", None, ["d"])
    orphan_out = gs.Variable("orphan_out", None, None)
    gs.Node("Relu", "gone", inputs=[graph.inputs[0]], outputs=[orphan_out])  # its producer is in no graph
    twin = gs.Variable(graph.nodes[0].outputs[0].name, None, None)
    graph.nodes.append(gs.Node("Sum", "reader", inputs=[dangling, orphan_out, twin, gs.Constant("c", np.ones(2))],
                               outputs=[gs.Variable("r", np.float32, [2])]))
    mentioned = [*graph.inputs, *(t for n in graph.nodes for t in (*n.inputs, *n.outputs)), *graph.outputs]
    variables = [t for t in mentioned if t.name and isinstance(t, gs.Variable)]
    untyped = {t.name for t in variables if t.dtype is None}
    dynamic = {t.name for t in variables if t.shape is None or not all(isinstance(d, int) and d >= 0 for d in t.shape)}
    found = loose_tensors(graph)
    assert {"dangling", twin.name} <= found[0]
    # the one it leaves out: an input whose producer left the graph, which `invariants.check` names as dangling
    assert found == (untyped - {"orphan_out"}, dynamic - {"orphan_out"})
    with pytest.raises(PassError, match="node 'reader' reads tensor 'dangling'"):
        check(graph, "p")


@pytest.mark.parametrize("kept", [False, True])
def test_replace_uses_with_a_kept_output_set_is_the_scan(kept):
    """`replace_uses(..., outputs=ids)` gives the graph the scan over graph.outputs gives, and leaves
    `ids` the ids of the new outputs: a rename (the new tensor takes the output's name), an Identity
    (the new tensor is a graph input), and a tensor that is no output."""
    x = gs.Variable("x", np.float32, [2])
    a, b, c = (gs.Variable(n, np.float32, [2]) for n in "abc")
    nodes = [gs.Node("Relu", "r1", inputs=[x], outputs=[a]), gs.Node("Relu", "r2", inputs=[a], outputs=[b]),
             gs.Node("Neg", "n", inputs=[a], outputs=[c])]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[b, c])
    ids = {id(t) for t in graph.outputs} if kept else None
    gu.replace_uses(graph, b, a, ids)  # a takes the name "b"
    gu.replace_uses(graph, c, x, ids)  # x is a graph input: an Identity keeps "c"
    other = gs.Variable("d", np.float32, [2])
    gu.replace_uses(graph, other, x, ids)  # no output: nothing changes
    assert [t.name for t in graph.outputs] == ["b", "c"] and graph.outputs[0] is a
    assert graph.nodes[-1].op == "Identity" and graph.nodes[-1].inputs[0] is x
    if kept:
        assert ids == {id(t) for t in graph.outputs}


@st.composite
def _flawed_graphs(draw):
    """A function building a random DAG (listed in order, or not) whose tensors may be untyped or
    symbolic, with some of: a dangling input, an input whose producer left the graph, a name two
    tensors share (a node's output or a constant), a graph output nothing produces, a node mixing
    float dtypes. Each call builds the same graph afresh."""
    count = draw(st.integers(1, 12))
    spec = [(draw(st.lists(st.integers(0, i), min_size=1, max_size=3)),
             draw(st.sampled_from([np.float32, np.float32, np.float16, None])),
             draw(st.sampled_from([[2], [2], ["s", 2], None])),
             draw(st.sampled_from(["Add", "Sum", "Relu", "Where"]))) for i in range(count)]
    flaws = draw(st.sets(st.sampled_from(["dangling", "orphan", "twin", "constant twin", "unproduced"])))
    order = draw(st.permutations(range(count + 1))) if draw(st.booleans()) else range(count + 1)

    def build() -> gs.Graph:
        x = gs.Variable("x", np.float32, [2])
        tensors, nodes = [x], []
        for i, (reads, dtype, shape, op) in enumerate(spec):
            out = gs.Variable(f"t{i}", dtype, list(shape) if shape else shape)
            nodes.append(gs.Node(op, f"n{i}", inputs=[tensors[j] for j in reads], outputs=[out]))
            tensors.append(out)
        extra = []
        if "dangling" in flaws:
            extra.append(gs.Variable("dangling", np.float32, [2]))
        if "orphan" in flaws:
            orphan = gs.Variable("orphan", None, None)
            gs.Node("Relu", "gone", inputs=[x], outputs=[orphan])
            extra.append(orphan)
        if "twin" in flaws:
            extra.append(gs.Variable(tensors[-1].name, None, ["s"]))
        if "constant twin" in flaws:
            extra.append(gs.Constant(tensors[-2].name, np.ones(2, np.float32)))
        nodes.append(gs.Node("Sum", "reader", inputs=[tensors[-1], *extra], outputs=[gs.Variable("r", np.float32, [2])]))
        outputs = [nodes[-1].outputs[0]] + ([gs.Variable("unproduced", np.float32, [2])] if "unproduced" in flaws else [])
        return gs.Graph([nodes[i] for i in order], [x], outputs, opset=17)

    return build


@settings(max_examples=150, deadline=None)
@given(_flawed_graphs())
def test_restores_sweep_finds_what_the_checks_find(build):
    """Where `restore` takes its two sweeps (a plain graph listed in an order), its `Sweep` holds
    `loose_tensors` of the graph it leaves, `sound` exactly when `check` (loose tensors aside)
    passes, and `mixed` exactly when `check_dtypes` raises; and it leaves the nodes the full cleanup
    and sort leave."""
    from mtkc.manager.invariants import check, check_dtypes, loose_tensors

    mine, theirs = build(), build()
    sweep = restore(mine, "p")
    gu.cleanup(theirs)
    theirs.nodes = topo_order(theirs)
    assert [n.name for n in mine.nodes] == [n.name for n in theirs.nodes]
    if sweep is None:
        return
    assert sweep.loose == loose_tensors(mine)

    def raises(fn, *args) -> bool:
        try:
            fn(*args)
        except (PassError, InternalError):
            return True
        return False

    assert sweep.sound == (not raises(check, mine, "p"))
    assert sweep.mixed == raises(check_dtypes, mine, None)
