"""Which nodes are decoder layer i's: one definition for `--chunks` and for quantisation units.

    boundary b_i     the residual-stream tensor entering layer i: the nearest dominator of the
                     logits (or `hidden_states_out`) that dominates layer i's attention anchor, on
                     paths from the token input (`input_ids`/`hidden_states`), Shape/Size edges ignored
    b_N              the residual stream leaving the last layer: the DecoderMap's `residual_out`
                     (else the LM head's input)
    layer i's nodes  those computed from b_i and not from b_{i+1} (data edges, not Shape/Size): its
                     attention, MLP, both residual adds (b_{i+1}'s producer is layer i's) and the
                     producers of its present outputs; what no b_i reaches (RoPE tables, mask) is in no layer

Layer i is the DecoderMap's layer i (`mtkc.analysis.decoder`), whose cache reads `past_<kind>_<i>`
after `kv-cache`. No weight is read.
"""

from __future__ import annotations

from typing import NamedTuple

import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap
from mtkc.contract import io
from mtkc.errors import InputError
from mtkc.ir.graph_utils import tensor_map

_SKIP = ("Shape", "Size")


class Region(NamedTuple):
    nodes: list[gs.Node]  # in graph order
    output: gs.Tensor | None  # the residual stream leaving the layer (b_{i+1})


def layer_boundaries(graph: gs.Graph, dm: DecoderMap) -> dict[int, gs.Variable]:
    """{layer index: the residual-stream tensor entering it} of the map's layers (see the module docstring)."""
    sources = [x for x in graph.inputs if x.name in (io.INPUT_IDS, io.HIDDEN_STATES)]
    sink = next((o for name in (io.LOGITS, io.HIDDEN_STATES_OUT) for o in graph.outputs if o.name == name), None)
    if not sources or sink is None or not sink.inputs:
        raise InputError("layer boundaries need a token input (input_ids or hidden_states) and a logits output")
    import networkx as nx  # here, not at the top: 0.1 s of every command's start, and only this needs it

    dag = nx.DiGraph()
    src, end = "<src>", "<sink>"
    for node in graph.nodes:
        for out in node.outputs:
            for user in out.outputs:
                if user.op not in _SKIP:
                    dag.add_edge(id(node), id(user))
    for node in sources[0].outputs:
        dag.add_edge(src, id(node))
    dag.add_edge(id(sink.inputs[0]), end)
    idom = nx.immediate_dominators(dag, src)
    if end not in idom:
        raise InputError(f"{sink.name} is not computed from the token input")
    chain, x = [], end
    while x != src:
        x = idom[x]
        chain.append(x)
    on_chain = set(chain)
    by_name = {node.name: node for node in graph.nodes}
    by_id = {id(node): node for node in graph.nodes}
    bounds = {}
    for layer in dm.layers:
        x = id(by_name[layer.anchor])
        if x not in idom:
            raise InputError(f"layer {layer.index}: its attention '{layer.anchor}' does not depend on the token input")
        while x not in on_chain:
            x = idom[x]
        if x == src:
            bounds[layer.index] = sources[0]
            continue
        node = by_id[x]
        if len(node.outputs) != 1:
            raise InputError(f"layer {layer.index}: boundary node '{node.name}' has {len(node.outputs)} outputs")
        bounds[layer.index] = node.outputs[0]
    return bounds


def layer_regions(graph: gs.Graph, dm: DecoderMap) -> dict[int, Region]:
    """{layer index: its nodes and output} (see the module docstring); {} without layers. When the map
    found no `residual_out` for the last layer, it ends at the LM head's input (the final norm is then
    the last layer's)."""
    if not dm.layers:
        return {}
    bounds = layer_boundaries(graph, dm)
    last = dm.layers[-1]
    head = next((n for n in graph.nodes if n.name == dm.logits), None)
    end = tensor_map(graph).get(last.residual_out) or (head.inputs[0] if head is not None else None)
    ends = {x.index: bounds[y.index] for x, y in zip(dm.layers, dm.layers[1:])} | {last.index: end}
    taken = _below(end, set()) if end is not None else set()
    members: dict[int, set[int]] = {}
    for layer in reversed(dm.layers):  # the nodes from b_{i+1} on are taken already
        members[layer.index] = _below(bounds[layer.index], taken)
        taken |= members[layer.index]
    return {i: Region([n for n in graph.nodes if id(n) in members[i]], ends[i]) for i in sorted(members)}


def _below(tensor: gs.Tensor, taken: set[int]) -> set[int]:
    """Ids of the nodes computed from `tensor` along data edges (not Shape/Size), not entering `taken`."""
    found, stack = set(), [tensor]
    while stack:
        for user in stack.pop().outputs:
            if id(user) in taken or id(user) in found or user.op in _SKIP:
                continue
            found.add(id(user))
            stack += user.outputs
    return found
