"""A copy of an imported graph, as graphsurgeon's importer would give it again, without the proto.

    clone(graph) -> gs.Graph | None

New nodes and tensors, linked in the same orders (each tensor's producers and consumers, each
node's inputs and outputs), so every walk and every export of the copy matches a re-import byte
for byte. Shared with the original, as a re-import shares them: the constants' lazy values (the
same TensorProtos) and immutable attribute values. Copied: attribute lists, tensor shapes, the
opset ids. Built by setting the objects' fields directly: graphsurgeon's constructors and
synchronised lists cost most of an import.

None (re-import instead) for a graph with local functions or subgraphs (their tensors reach into
the outer graph), or with a node linked to a tensor outside it.
"""

from __future__ import annotations

from collections import OrderedDict

import onnx_graphsurgeon as gs
from onnx_graphsurgeon.util.misc import SynchronizedList

from mtkc.ir.counts import count

_set = object.__setattr__  # field by field in the importer's order, past graphsurgeon's __setattr__: compact dicts


def clone(graph: gs.Graph) -> gs.Graph | None:
    if graph.functions or any(isinstance(v, (gs.Graph, gs.Node.AttributeRef)) for n in graph.nodes
                              for v in n.attrs.values()):
        return None
    tensors: dict[int, tuple[gs.Tensor, gs.Tensor]] = {}  # id of the original -> (original, copy)
    nodes: dict[int, gs.Node] = {}

    def tensor(t: gs.Tensor) -> gs.Tensor:
        pair = tensors.get(id(t))
        if pair is not None:
            return pair[1]
        copy = object.__new__(type(t))
        tensors[id(t)] = t, copy
        for key, value in t.__dict__.items():
            if key == "inputs" or key == "outputs":
                value = linked(copy, "outputs" if key == "inputs" else "inputs")
            elif key == "shape" and type(value) is list:
                value = list(value)
            _set(copy, key, value)
        return copy

    for node in graph.nodes:
        copy = nodes[id(node)] = object.__new__(gs.Node)
        for key, value in node.__dict__.items():
            if key == "attrs":
                value = OrderedDict((k, _attr(v, tensor)) for k, v in value.items())
            elif key == "inputs" or key == "outputs":
                value = linked(copy, "outputs" if key == "inputs" else "inputs")
            _set(copy, key, value)
        list.extend(copy.inputs, [tensor(t) for t in node.inputs])
        list.extend(copy.outputs, [tensor(t) for t in node.outputs])
    for t in graph.inputs + graph.outputs:  # I/O tensors no node touches
        tensor(t)
    for t, copy in list(tensors.values()):  # tensor attributes among them: no producers, no readers
        try:
            list.extend(copy.inputs, [nodes[id(n)] for n in t.inputs])
            list.extend(copy.outputs, [nodes[id(n)] for n in t.outputs])
        except KeyError:  # linked to a node outside the graph
            return None
    result = object.__new__(gs.Graph)
    fields = dict(graph.__dict__)
    fields.update(nodes=[nodes[id(n)] for n in graph.nodes], inputs=[tensor(t) for t in graph.inputs],
                  outputs=[tensor(t) for t in graph.outputs], _functions=[])
    if graph.import_domains is not None:
        fields["import_domains"] = [copy_message(o) for o in graph.import_domains]
    result.__dict__.update(fields)
    count("graph copies")
    return result


def linked(owner, field: str) -> SynchronizedList:
    """An empty SynchronizedList of `owner` (filled with list.extend: both sides are set by hand)."""
    linked = SynchronizedList.__new__(SynchronizedList)
    linked.parent_obj, linked.field_name = owner, field
    return linked


def _attr(value, tensor):
    if isinstance(value, gs.Constant):  # a tensor attribute: its own Constant, as the importer makes
        return tensor(value)
    if isinstance(value, list):
        return list(value)
    return value


def copy_message(message):
    """A protobuf message copied with its field presence (so graphs written stay byte-identical)."""
    copy = type(message)()
    copy.CopyFrom(message)
    return copy
