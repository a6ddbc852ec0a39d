"""Cut a partitioned graph into one ONNX per partition and describe how they are wired.

A partition's inputs are the tensors its nodes read that another partition (or the graph) makes;
its outputs are the tensors it makes that another partition reads or that are graph outputs
(ORT's `MakeComputeCapability`). Boundary tensors keep their graph names, so the manifest wires
partitions by name. Weights stay inside the partition that uses them; the shared WeightWriter
stores each weight once however many partitions or graphs use it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import onnx_graphsurgeon as gs

from mtkc.backend.manifest import tensor_spec
from mtkc.backend.partition import (
    CPU,
    NPU,
    Partition,
    Placement,
    name_nodes,
    node_inputs,
    parse_patterns,
    partition,
    place,
    unmatched,
)
from mtkc.errors import PassError
from mtkc.ir.graph_utils import Names
from mtkc.ir.opset import NPU_OPSET, import_domains

log = logging.getLogger("mtkc")


@dataclass
class Piece:
    """One partition cut out as its own graph, with its manifest entry (`path` relative to OUT)."""

    entry: dict
    graph: gs.Graph


@dataclass
class Split:
    """A graph's partitions, final placements, and the pieces to write."""

    parts: list[Partition] = field(default_factory=list)
    placements: dict[str, Placement] = field(default_factory=dict)
    pieces: list[Piece] = field(default_factory=list)

    @property
    def entries(self) -> list[dict]:
        return [p.entry for p in self.pieces]


def split(
    graph: gs.Graph,
    graph_name: str,
    verdict: Callable[[gs.Node], object],
    min_partition_nodes: int | None = None,
    force_cpu: Sequence[str] | None = None,
    force_npu: Sequence[str] | None = None,
) -> Split:
    """Name nodes, place them (table verdicts + user patterns), partition, cut: compile's one call."""
    produce_constant_outputs(graph)
    name_nodes(graph)
    cpu_patterns = parse_patterns(force_cpu, "--force-cpu")
    npu_patterns = parse_patterns(force_npu, "--force-npu")
    for pattern in unmatched(graph, cpu_patterns + npu_patterns):
        log.warning("mtkc: pattern '%s' matches no node of graph '%s'", pattern, graph_name)
    parts, placements = partition(graph, place(graph, verdict, cpu_patterns, npu_patterns), min_partition_nodes or 1)
    return Split(parts, placements, cut(graph, parts, placements, graph_name))


def produce_constant_outputs(graph: gs.Graph) -> None:
    """A graph output that is a constant gets a producer (`Identity`), so a partition makes it:
    partitions hand tensors on by name, and no partition would otherwise output it."""

    names = None
    for k, t in enumerate(graph.outputs):
        if isinstance(t, gs.Constant):
            names = names or Names(graph)
            name = t.name
            t.name = names.new(f"{name}/value")
            out = gs.Variable(name, dtype=t.dtype, shape=list(t.shape))
            graph.nodes.append(gs.Node("Identity", names.new(f"{name}/identity"), inputs=[t], outputs=[out]))
            graph.outputs[k] = out


def boundaries(graph: gs.Graph, parts: list[Partition]) -> list[tuple[list[gs.Variable], list[gs.Variable]]]:
    """(inputs, outputs) per partition, in first-use / production order."""
    owner: dict[int, int] = {}
    for k, part in enumerate(parts):
        owner.update((id(n), k) for n in part.nodes)
    readers: dict[int, set[int]] = {}
    for node in graph.nodes:
        for t in node_inputs(node):
            readers.setdefault(id(t), set()).add(owner[id(node)])
    graph_outputs = {id(t) for t in graph.outputs}
    result = []
    for k, part in enumerate(parts):
        inputs: dict[str, gs.Variable] = {}
        outputs: dict[str, gs.Variable] = {}
        for node in part.nodes:
            for t in node_inputs(node):
                if isinstance(t, gs.Variable) and t.name and not (t.inputs and owner.get(id(t.inputs[0])) == k):
                    inputs.setdefault(t.name, t)
            for t in node.outputs:
                if t.name and (id(t) in graph_outputs or readers.get(id(t), set()) - {k}):
                    outputs.setdefault(t.name, t)
        result.append((list(inputs.values()), list(outputs.values())))
    return result


def cut(graph: gs.Graph, parts: list[Partition], placements: dict[str, Placement], graph_name: str) -> list[Piece]:
    """One graph per partition, to be saved as `<graph_name>.<id>.onnx` beside the weights
    (flat: onnxruntime refuses external data outside the model's folder)."""
    producer = {}
    for part in parts:
        producer.update((id(t), part.id) for n in part.nodes for t in n.outputs)
    pieces = []
    for part, (inputs, outputs) in zip(parts, boundaries(graph, parts)):
        for t in inputs + outputs:
            made = f" (made by {t.inputs[0].op} node '{t.inputs[0].name}')" if t.inputs else ""
            if t.dtype is None:
                raise PassError(f"partition {graph_name}/{part.id}: boundary tensor '{t.name}'{made} has no dtype "
                                "(shape inference could not type it)")
            if part.target == NPU and not _static(t):
                raise PassError(f"partition {graph_name}/{part.id}: boundary tensor '{t.name}'{made} has no static "
                                f"shape {t.shape}")
        sub = gs.Graph(
            nodes=list(part.nodes),
            inputs=inputs,
            outputs=outputs,
            name=f"{graph_name}_{part.id}",
            opset=min(graph.opset, NPU_OPSET) if part.target == NPU else graph.opset,  # NPU nodes have opset-17 forms
            import_domains=import_domains(graph.import_domains, min(graph.opset, NPU_OPSET))
            if part.target == NPU and graph.import_domains else graph.import_domains,
            producer_name="mtkc",
            functions=used_functions(graph, part.nodes),
        )
        entry = {
            "id": part.id,
            "target": part.target,
            "path": f"{graph_name}.{part.id}.onnx",
            "inputs": [{**tensor_spec(t), "from": producer.get(id(t), "graph")} for t in inputs],
            "outputs": [tensor_spec(t) for t in outputs],
            "nodes": [n.name for n in part.nodes],
        }
        if part.target == CPU:
            entry["cpu_reasons"] = {n.name: _reason(placements[n.name]) for n in part.nodes}
        pieces.append(Piece(entry, sub))
    return pieces


def used_functions(graph: gs.Graph, nodes: Sequence[gs.Node]) -> list[gs.Function]:
    """The model-local functions `nodes` call, directly or through other functions (file order)."""
    by_key = {(f.domain, f.name): f for f in graph.functions}
    used: set[tuple[str, str]] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        key = (node.domain or "", node.op)
        if key in by_key and key not in used:
            used.add(key)
            stack.extend(by_key[key].nodes)
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                stack.extend(value.nodes)
    return [f for f in graph.functions if (f.domain, f.name) in used]


def _static(t: gs.Variable) -> bool:
    return t.shape is not None and all(isinstance(d, int) and d >= 0 for d in t.shape)


def _reason(p: Placement) -> str:
    return f"{p.reason}: {p.detail}" if p.detail else p.reason
