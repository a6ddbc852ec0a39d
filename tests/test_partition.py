"""Partitioning: random DAGs x random support masks (hypothesis) plus hand-made cases."""

from __future__ import annotations

from types import SimpleNamespace

import networkx as nx
import numpy as np
import onnx_graphsurgeon as gs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtkc.backend.partition import CPU, NPU, name_nodes, parse_patterns, partition, place
from mtkc.errors import InputError


def make_dag(edges_spec: list[list[int]], n_inputs: int = 2) -> gs.Graph:
    """Node k reads the tensors listed in edges_spec[k]: indices < n_inputs are graph inputs,
    index n_inputs + j is node j's output. Nodes with no consumer feed graph outputs."""
    inputs = [gs.Variable(f"in{i}", np.float32, (1, 4)) for i in range(n_inputs)]
    tensors = list(inputs)
    nodes = []
    for k, srcs in enumerate(edges_spec):
        out = gs.Variable(f"t{k}", np.float32, (1, 4))
        op = "Add" if len(srcs) == 2 else "Relu"
        nodes.append(gs.Node(op, f"n{k}", inputs=[tensors[s] for s in srcs], outputs=[out]))
        tensors.append(out)
    used = {id(t) for n in nodes for t in n.inputs}
    outputs = [t for t in tensors[n_inputs:] if id(t) not in used]
    return gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, opset=17)


@st.composite
def dags(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    spec = []
    for k in range(n):
        arity = draw(st.integers(1, 2))
        spec.append(draw(st.lists(st.integers(0, 2 + k - 1), min_size=arity, max_size=arity)))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return spec, mask


def verdict_from(mask_by_name: dict[str, bool]):
    def verdict(node):
        ok = mask_by_name[node.name]
        return SimpleNamespace(supported=ok, reason="" if ok else "op-not-in-table", detail="")

    return verdict


def node_graph(graph: gs.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(n.name for n in graph.nodes)
    for n in graph.nodes:
        for t in n.inputs:
            if t.inputs:
                g.add_edge(t.inputs[0].name, n.name)
    return g


def check_invariants(graph, parts, placements, mask_by_name):
    owner = {}
    for k, p in enumerate(parts):
        for n in p.nodes:
            assert n.name not in owner, f"{n.name} placed twice"
            owner[n.name] = k
            assert placements[n.name].target == p.target
    assert set(owner) == {n.name for n in graph.nodes}
    for p in parts:
        assert p.nodes, "empty partition"
        if p.target == NPU:
            assert all(mask_by_name[n.name] for n in p.nodes)
    # Edges only go forward in the partition sequence: the quotient graph is a DAG in this order,
    # hence every partition is convex (a path out and back would be a backward edge).
    g = node_graph(graph)
    for a, b in g.edges:
        assert owner[a] <= owner[b], f"edge {a}->{b} goes backwards"
    quotient = nx.DiGraph((owner[a], owner[b]) for a, b in g.edges if owner[a] != owner[b])
    assert nx.is_directed_acyclic_graph(quotient)
    for k, p in enumerate(parts):  # direct convexity check, independent of the order argument
        inside = {n.name for n in p.nodes}
        outside_reach = set().union(*(nx.descendants(g, v) for v in inside)) - inside
        assert not any(inside & nx.descendants(g, v) for v in outside_reach), f"partition {p.id} not convex"
    for a, b in zip(parts, parts[1:]):
        assert a.target != b.target, "adjacent partitions of the same target were not merged"


@settings(max_examples=250, deadline=None)
@given(dags())
def test_random_dags_partition_invariants(case):
    spec, mask = case
    graph = make_dag(spec)
    mask_by_name = {f"n{k}": m for k, m in enumerate(mask)}
    placements = place(graph, verdict_from(mask_by_name))
    parts, final = partition(graph, placements)
    check_invariants(graph, parts, final, mask_by_name)
    again, _ = partition(make_dag(spec), place(make_dag(spec), verdict_from(mask_by_name)))
    assert [(p.id, [n.name for n in p.nodes]) for p in again] == [(p.id, [n.name for n in p.nodes]) for p in parts]
    if all(mask):
        assert [p.target for p in parts] == [NPU]
    if not any(mask):
        assert [p.target for p in parts] == [CPU]


@settings(max_examples=200, deadline=None)
@given(dags(), st.integers(2, 5))
def test_random_dags_min_partition_nodes(case, minimum):
    spec, mask = case
    graph = make_dag(spec)
    mask_by_name = {f"n{k}": m for k, m in enumerate(mask)}
    parts, final = partition(graph, place(graph, verdict_from(mask_by_name)), min_partition_nodes=minimum)
    check_invariants(graph, parts, final, mask_by_name)
    assert all(len(p.nodes) >= minimum for p in parts if p.target == NPU)
    for name, pl in final.items():
        if pl.target == CPU and mask_by_name[name]:
            assert pl.reason == "partition-too-small"


def test_independent_cpu_node_runs_before_the_group():
    # n0 (npu) and n1 (cpu) read graph inputs; n2 (npu) reads both: ORT's wave puts n1 first
    # so n0 and n2 share one NPU partition.
    graph = make_dag([[0], [1], [2, 3]])
    parts, _ = partition(graph, place(graph, verdict_from({"n0": True, "n1": False, "n2": True})))
    assert [(p.id, [n.name for n in p.nodes]) for p in parts] == [("cpu0", ["n1"]), ("npu1", ["n0", "n2"])]


def test_cpu_node_between_npu_nodes_splits_and_min_size_merges_to_cpu():
    graph = make_dag([[0], [2], [3], [4]])  # chain n0 -> n1 -> n2 -> n3
    mask = {"n0": True, "n1": False, "n2": True, "n3": True}
    parts, _ = partition(graph, place(graph, verdict_from(mask)))
    assert [(p.id, len(p.nodes)) for p in parts] == [("npu0", 1), ("cpu1", 1), ("npu2", 2)]
    parts, final = partition(graph, place(graph, verdict_from(mask)), min_partition_nodes=2)
    assert [(p.id, len(p.nodes)) for p in parts] == [("cpu0", 2), ("npu1", 2)]
    assert final["n0"].reason == "partition-too-small"
    assert final["n1"].reason == "op-not-in-table"


def test_force_cpu_and_force_npu():
    graph = make_dag([[0], [2], [3]])  # Relu chain
    mask = {"n0": True, "n1": True, "n2": False}
    placements = place(graph, verdict_from(mask), force_cpu=parse_patterns(["node:n1"], "--force-cpu"))
    assert placements["n1"].target == CPU and placements["n1"].detail == "--force-cpu node:n1"
    placements = place(
        graph,
        verdict_from(mask),
        force_cpu=parse_patterns(["op:Relu"], "--force-cpu"),
        force_npu=parse_patterns(["node:n0"], "--force-npu"),
    )
    assert [placements[f"n{k}"].target for k in range(3)] == [NPU, CPU, CPU]
    parts, _ = partition(graph, placements, min_partition_nodes=5)  # forced nodes ignore the minimum
    assert [p.id for p in parts] == ["npu0", "cpu1"]
    with pytest.raises(InputError, match=r"node 'n2' \(Relu\) is not supported on the NPU: op-not-in-table"):
        place(graph, verdict_from(mask), force_npu=parse_patterns(["node:n*"], "--force-npu"))
    with pytest.raises(InputError, match="expected op:TYPE or node:GLOB"):
        parse_patterns(["Relu"], "--force-cpu")


def test_name_nodes_fills_and_dedupes():
    graph = make_dag([[0], [2], [3]])
    graph.nodes[0].name = ""
    graph.nodes[2].name = "n1"
    name_nodes(graph)
    assert [n.name for n in graph.nodes] == ["Relu_0", "n1", "n1_0"]


def test_linear_time_on_long_chain():
    import time

    n = 20000
    graph = make_dag([[0]] + [[k + 1] for k in range(1, n)])
    mask = {f"n{k}": k % 3 != 0 for k in range(n)}
    start = time.perf_counter()
    parts, _ = partition(graph, place(graph, verdict_from(mask)), min_partition_nodes=3)
    assert time.perf_counter() - start < 5
    assert sum(len(p.nodes) for p in parts) == n


@settings(max_examples=25, deadline=None)
@given(dags(max_nodes=12))
def test_stitched_partitions_compute_the_whole_graph(case):
    """Cut into one ONNX per partition, run in order by boundary names: same outputs as the graph."""
    from mtkc.backend.stitch import cut
    from mtkc.ir.execute import run

    spec, mask = case
    graph = make_dag(spec)
    parts, placements = partition(graph, place(graph, verdict_from({f"n{k}": m for k, m in enumerate(mask)})))
    pieces = cut(graph, parts, placements, "g")
    feeds = {f"in{i}": np.full((1, 4), i + 1.5, np.float32) for i in range(2)}
    env = dict(feeds)
    for piece in pieces:
        assert {i["from"] for i in piece.entry["inputs"]} <= {"graph"} | {p.entry["id"] for p in pieces}
        env.update(run(piece.graph, {i["name"]: env[i["name"]] for i in piece.entry["inputs"]}))
    whole = run(graph, {k: v for k, v in feeds.items() if any(t.name == k for t in graph.inputs)})
    for name, value in whole.items():
        np.testing.assert_array_equal(env[name], value)


@settings(max_examples=100, deadline=None)
@given(dags(), st.randoms(use_true_random=False))
def test_unsorted_node_list_still_gives_sorted_partitions(case, rnd):
    spec, mask = case
    graph = make_dag(spec)
    rnd.shuffle(graph.nodes)
    mask_by_name = {f"n{k}": m for k, m in enumerate(mask)}
    parts, final = partition(graph, place(graph, verdict_from(mask_by_name)))
    check_invariants(graph, parts, final, mask_by_name)
    for p in parts:
        position = {n.name: k for k, n in enumerate(p.nodes)}
        for n in p.nodes:
            for t in n.inputs:
                if t.inputs and t.inputs[0].name in position:
                    assert position[t.inputs[0].name] < position[n.name]


def test_subgraph_reads_count_as_edges():
    """An If whose branch reads an outer tensor depends on that tensor's producer."""
    x = gs.Variable("x", np.float32, (1, 4))
    cond = gs.Variable("cond", np.bool_, ())
    a, b, y = (gs.Variable(n, np.float32, (1, 4)) for n in ("a", "b", "y"))
    branch_out = gs.Variable("branch_out", np.float32, (1, 4))
    branch = gs.Graph(nodes=[gs.Node("Relu", "inner", inputs=[a], outputs=[branch_out])], outputs=[branch_out])
    nodes = [
        gs.Node("Sin", "producer", inputs=[x], outputs=[a]),  # CPU
        gs.Node("If", "if", inputs=[cond], outputs=[b], attrs={"then_branch": branch, "else_branch": branch}),
        gs.Node("Relu", "after", inputs=[b], outputs=[y]),
    ]
    graph = gs.Graph(nodes=[nodes[1], nodes[0], nodes[2]], inputs=[x, cond], outputs=[y], opset=17)
    parts, _ = partition(graph, place(graph, verdict_from({"producer": False, "if": True, "after": True})))
    assert [(p.id, [n.name for n in p.nodes]) for p in parts] == [("cpu0", ["producer"]), ("npu1", ["if", "after"])]
    from mtkc.backend.stitch import boundaries

    (_, cpu_out), (npu_in, _) = boundaries(graph, parts)
    assert [t.name for t in cpu_out] == ["a"] and [t.name for t in npu_in] == ["cond", "a"]
