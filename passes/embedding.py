"""Embedding: the vocabulary lookup goes to the host when the SDK table says so.

    input_ids ─ Gather(W_embed[V, H], ·) ─ hidden   (anchor: each Gather over a constant 2-D
                                                      table indexed by a graph input other than
                                                      position_ids; RoPE tables are not lookups)

MDLA has no large-table Gather (MediaTek's runtime looks tokens up on the CPU and feeds hidden
states), so when the table's verdict for the Gather is target "host", per option `embedding`:

    host-input (default)  the graph input becomes `hidden_states` [B, T, H] (float); the Gather
                          goes, and its weight leaves the graph unless something else (a tied
                          lm_head) still reads it
    cpu                   the Gather stays; the partitioner places it on the CPU

Refused: a Gather whose verdict is not "host" (the NPU can run it), an unknown option.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.constants import constant_of
from mtkc.ir.graph_utils import cleanup, replace_uses
from mtkc.rewrite.markers import ROPE_TABLE
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

NAME = "hidden_states"
MODES = ("host-input", "cpu")


def _source(tensor: gs.Tensor, graph: gs.Graph) -> gs.Tensor | None:
    """The graph input behind `tensor` (through Casts), or None."""
    while tensor not in graph.inputs:
        if len(tensor.inputs) != 1 or tensor.inputs[0].op != "Cast":
            return None
        tensor = tensor.inputs[0].inputs[0]
    return tensor


def find(graph: gs.Graph):
    """(Gather, table constant, ids input) for every vocabulary lookup (not RoPE's position tables)."""
    sites = []
    for node in graph.nodes:
        if node.op == "Gather" and node.attrs.get("axis", 0) == 0 and len(node.inputs) == 2:
            table = constant_of(node.inputs[0])
            ids = _source(node.inputs[1], graph)
            if table is not None and len(table.shape) == 2 and ids is not None and ids.name != "position_ids" \
                    and ROPE_TABLE not in table.name:
                sites.append((node, table, ids))
    return sites


def _read_shape_from(ids: gs.Tensor, hidden: gs.Tensor) -> None:
    """Shape(ids) (unbound shapes) -> the same dims of hidden [.., T, H]: ids no longer needed."""
    rank = len(ids.shape) if ids.shape is not None else None
    for reader in [n for n in ids.outputs if n.op == "Shape"]:
        if rank is None:
            continue
        start, end = reader.attrs.get("start", 0), reader.attrs.get("end", rank)
        reader.attrs["start"] = start - 1 if start < 0 else start
        reader.attrs["end"] = end - 1 if end < 0 else min(end, rank)
        reader.inputs[0] = hidden


@register
class Embedding(Pass):
    name = "embedding"
    description = "token embedding Gather to the host: hidden_states input (or left for the CPU)"

    def __init__(self):
        self.lookups: list[tuple[str, gs.Constant]] = []  # (ids input name, table) replaced

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        mode = ctx.options.get("embedding") or "host-input"
        sites = find(graph)
        if mode not in MODES:
            result.misses = [Miss(n.name, f"unknown embedding option '{mode}' ({' | '.join(MODES)})") for n, _, _ in sites]
            return result
        for node, table, ids in sites:
            verdict = ctx.table.verdict(node, graph.opset, ctx.read_values) if ctx.table is not None else None
            if verdict is not None and verdict.target != "host":
                result.misses.append(Miss(node.name, f"the SDK runs this Gather ({'supported' if verdict.supported else verdict.reason})"))
                continue
            if mode == "cpu":
                result.notes.append(f"{node.name}: left for the CPU (embedding=cpu)")
                continue
            out = node.outputs[0]
            shape = list(ids.shape or ["batch", "sequence"]) + [table.shape[1]]
            name = NAME if not any(t.name == NAME for t in graph.inputs) else f"{NAME}_{len(self.lookups)}"
            hidden = gs.Variable(name, dtype=np.dtype(table.dtype), shape=shape)
            graph.inputs.append(hidden)
            replace_uses(graph, out, hidden)
            node.outputs.clear()
            if graph.opset >= 15:  # Shape start/end
                _read_shape_from(ids, hidden)
            self.lookups.append((ids.name, table, name))
            result.rewrites += 1
        if result.rewrites:
            cleanup(graph)
            used = {t.name for n in graph.nodes for t in n.inputs}
            graph.inputs = [t for t in graph.inputs if t.name in used or t.name not in {i for i, _, _ in self.lookups}]
        return result

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """hidden_states = W_embed[input_ids]."""
        if not self.lookups:
            return feeds
        feeds = dict(feeds)
        read = ctx.read_values or (lambda c: c.values)
        for ids, table, name in self.lookups:
            if ids in feeds:
                feeds[name] = np.asarray(read(table))[np.asarray(feeds[ids]).astype(np.int64)]
        for ids, _, _ in self.lookups:
            feeds.pop(ids, None)
        return feeds
