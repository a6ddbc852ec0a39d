"""Embedding: the vocabulary lookup goes to the host when the SDK table says so.

    input_ids ─[Cast]─ Gather(W_embed[V, H], ·) ─ hidden   (anchor: each Gather over a constant
                                                        2-D table indexed by a graph input other
                                                        than position_ids; RoPE tables are not lookups)

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

from mtkc.ir.constants import constant_of, values
from mtkc.rewrite.markers import ROPE_TABLE
from mtkc.rewrite.pass_api import Context, register
from mtkc.rewrite.pattern import Refused
from mtkc.rewrite.rules import Rule, RulePass

NAME = "hidden_states"
MODES = ("host-input", "cpu")


def _source(tensor: gs.Tensor, graph: gs.Graph) -> gs.Tensor | None:
    """The graph input behind `tensor` (through Casts), or None."""
    while not any(t is tensor for t in graph.inputs):
        if len(tensor.inputs) != 1 or tensor.inputs[0].op != "Cast":
            return None
        tensor = tensor.inputs[0].inputs[0]
    return tensor


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


class Lookup(Rule):
    anchor, sites = ("Gather",), "vocabulary lookup"

    def __init__(self, io):
        self.io = io  # the Embedding pass: `lookups` for its map_feeds

    def start(self, graph, ctx):
        self.graph, self.mode, self.left = graph, ctx.options.embedding or "host-input", 0

    def candidate(self, node):
        if node.attrs.get("axis", 0) != 0 or len(node.inputs) != 2:
            return False
        table, ids = constant_of(node.inputs[0]), _source(node.inputs[1], self.graph)
        return table is not None and len(table.shape) == 2 and ids is not None and ids.name != "position_ids" \
            and ROPE_TABLE not in table.name

    def check(self, ctx, m):
        node = m["node"]
        if self.mode not in MODES:
            raise Refused(f"unknown embedding option '{self.mode}' ({' | '.join(MODES)})")
        verdict = ctx.table.verdict(node, self.graph.opset, ctx.read_values) if ctx.table is not None else None
        if verdict is not None and verdict.target != "host":
            raise Refused(f"the SDK runs this Gather ({'supported' if verdict.supported else verdict.reason})")

    def done(self, ctx, m):
        self.left += self.mode == "cpu"
        return self.mode == "cpu"

    def rewrite(self, op, ctx, m):
        node = m["node"]
        table, ids = constant_of(node.inputs[0]), _source(node.inputs[1], self.graph)
        shape = list(ids.shape or ["batch", "sequence"]) + [table.shape[1]]
        name = NAME if not any(t.name == NAME for t in self.graph.inputs) else f"{NAME}_{len(self.io.lookups)}"
        hidden = gs.Variable(name, dtype=np.dtype(table.dtype), shape=shape)
        self.graph.inputs.append(hidden)
        if self.graph.opset >= 15:  # Shape start/end
            _read_shape_from(ids, hidden)
        self.io.lookups.append((ids.name, table, name))
        return [(node.outputs[0], hidden)]

    def finish(self, graph, ctx, result):
        if self.left:
            result.notes.append(f"{self.left} lookup(s) left for the CPU (embedding=cpu)")
        replaced = {i for i, _, _ in self.io.lookups}
        used = {t.name for n in graph.nodes for t in n.inputs}
        graph.inputs = [t for t in graph.inputs if t.name in used or t.name not in replaced]


@register
class Embedding(RulePass):
    name = "embedding"
    description = "token embedding Gather to the host: hidden_states input (or left for the CPU)"

    def __init__(self):
        self.lookups: list[tuple[str, gs.Constant, str]] = []  # (ids input name, table, new input name)
        self.rules = (Lookup(self),)

    def run(self, graph, ctx):
        result = super().run(graph, ctx)
        if self.lookups:  # host-input mode: the host looks the tokens up in W_embed [V, H]
            result.host["embedding"] = self.lookups[0][1]
        return result

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        """hidden_states = W_embed[input_ids]."""
        if not self.lookups:
            return feeds
        feeds = dict(feeds)
        for ids, table, name in self.lookups:
            if ids in feeds:
                feeds[name] = values(table, ctx.read_values)[np.asarray(feeds[ids]).astype(np.int64)]
        for ids, _, _ in self.lookups:
            feeds.pop(ids, None)
        return feeds
