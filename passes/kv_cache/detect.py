"""Finding the KV cache by structure, whatever the exporter named it.

A cache input is a rank-4 graph input that reaches, through copies (Identity, 1-input Concat, the
Q/DQ pairs a static QDQ model puts on every activation), `Concat(past, new, axis=2)` whose result
is a graph output (the present), directly or through a Q/DQ pair: `kv-cache` makes the Concat's
result the output, so the cache I/O of a QDQ model is float, as the converter's calibration expects. Its kind and layer
come from where the concat's result goes:

    present ─[layout, scale]─► MatMul(Q, ·ᵀ) ─► … ─► Softmax        key   (or input 1 of an attention op)
    Softmax ─► … ─► MatMul(P, ·) ◄─[layout]─ present                 value (or input 2 of an attention op)

the layer being the rank of that attention among the model's attentions, in graph order.
After `kv-cache` the inputs carry contract names (`past_key_<i>`), read by `layer_caches`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from mtkc.contract import io as contract_io
from mtkc.display import escape
from mtkc.errors import InputError

KINDS = contract_io.KINDS
ATTENTION_OPS = {"MultiHeadAttention", "Attention", "GroupQueryAttention", "PackedAttention"}
_QDQ = ("QuantizeLinear", "DequantizeLinear")
_COPIES = ("Identity", *_QDQ)
_LAYOUT = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Tile", "Mul", "Div", *_QDQ}
_PROB_PATH = {"Cast", "Where", "IsNaN", "Identity", *_QDQ}
_CONTRACT = re.compile(r"^past_(?P<kind>key|value)_(?P<i>\d+)$")


@dataclass
class LayerCache:
    index: int
    past: dict[str, gs.Variable]  # kind -> input
    concat: dict[str, gs.Node]  # kind -> Concat(past, new, axis=2)


def cache_concat(past: gs.Tensor, copies: tuple[str, ...] = _COPIES) -> gs.Node | None:
    """The `Concat(past, new, axis=2)` a cache input feeds, through Identity / 1-input Concat copies."""
    tensor = past
    for _ in range(8):
        nxt = None
        for node in tensor.outputs:
            if node.op == "Concat" and len(node.inputs) == 2 and node.inputs[0] is tensor:
                if node.attrs.get("axis") in (2, -2):
                    return node
            elif node.op in copies or (node.op == "Concat" and len(node.inputs) == 1):
                nxt = node.outputs[0]
        if nxt is None:
            return None
        tensor = nxt
    return None


def cache_output(concat: gs.Node, outputs: list[gs.Tensor]) -> gs.Tensor | None:
    """The graph output a cache Concat's result is: itself, or its Q -> DQ (a QDQ model)."""
    tensor = concat.outputs[0]
    for _ in range(3):
        if any(t is tensor for t in outputs):
            return tensor
        nxt = [n for n in tensor.outputs if n.op in _QDQ]
        if not nxt:
            return None
        tensor = nxt[0].outputs[0]
    return None


def _attention_use(present: gs.Tensor) -> tuple[str, gs.Node] | None:
    """(kind, the node that identifies the attention) for a present tensor, from its consumers."""
    frontier, seen = [present], set()
    while frontier:
        t = frontier.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for node in t.outputs:
            if node.op in ATTENTION_OPS and node.domain not in ("", "ai.onnx") and t in node.inputs[1:3]:
                return KINDS[node.inputs.index(t) - 1], node
            if node.op == "MatMul" and len(node.inputs) == 2 and node.inputs[1] is t:
                softmax = _softmax_above(node.inputs[0])
                if softmax is not None:
                    return "value", softmax
                softmax = _softmax_below(node.outputs[0])
                return ("key", softmax) if softmax is not None else None
            if node.op in _LAYOUT and node.outputs and node.inputs[0] is t:
                frontier.append(node.outputs[0])
    return None


def _softmax_above(tensor: gs.Tensor, depth: int = 10) -> gs.Node | None:
    for _ in range(depth):
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None:
            return None
        if node.op == "Softmax":
            return node
        if node.op not in _PROB_PATH:
            return None
        tensor = node.inputs[-1] if node.op == "Where" else node.inputs[0]
    return None


def _softmax_below(tensor: gs.Tensor, depth: int = 10) -> gs.Node | None:
    frontier = [tensor]
    for _ in range(depth):
        nxt = []
        for t in frontier:
            for node in t.outputs:
                if node.op == "Softmax":
                    return node
                if node.op in {"Add", "Where", "Mul", "Div", "Cast", "Sub", "Tanh", *_QDQ}:  # Tanh: soft-capping
                    nxt += node.outputs
        frontier = nxt
    return None


def find_caches(graph: gs.Graph) -> list[LayerCache]:
    """Every layer's cache I/O found by structure (see the module docstring); [] when there is none."""
    outputs = {id(t) for t in graph.outputs}
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    found: dict[int, dict[str, tuple[gs.Variable, gs.Node]]] = {}
    for tensor in graph.inputs:
        if tensor.shape is not None and len(tensor.shape) != 4:
            continue
        concat = cache_concat(tensor)
        if concat is None or cache_output(concat, graph.outputs) is None:
            _refuse_cropped(graph, tensor, outputs)
            continue
        use = _attention_use(concat.outputs[0])
        if use is None:
            raise InputError(f"cache input '{tensor.name}': its Concat '{concat.name}' feeds no attention "
                             "(MatMul -> Softmax -> MatMul, or an attention op)")
        kind, anchor = use
        slot = found.setdefault(order[id(anchor)], {})
        if kind in slot:
            raise InputError(f"cache inputs '{slot[kind][0].name}' and '{tensor.name}' are both the {kind} "
                             f"of the attention at '{anchor.name}'")
        slot[kind] = (tensor, concat)
    layers = []
    for i, key in enumerate(sorted(found)):
        slot = found[key]
        missing = [k for k in KINDS if k not in slot]
        if missing:
            have = next(iter(slot.values()))[0].name
            raise InputError(f"cache input '{have}' has no matching past {missing[0]} input")
        layers.append(LayerCache(i, {k: slot[k][0] for k in KINDS}, {k: slot[k][1] for k in KINDS}))
    return layers


def _refuse_cropped(graph: gs.Graph, past: gs.Tensor, outputs: set[int]) -> None:
    """A present that is the concat's last entries only (`Slice(concat, -W+1:)` on the sequence axis,
    the past sliced the same way: transformers' DynamicSlidingWindowLayer of sliding-window layers)
    is a cache mtkc cannot make static as exported: refused with the layer's tensors named and the
    way that works."""
    concat = cache_concat(past, _COPIES + ("Slice",))
    for node in concat.outputs[0].outputs if concat is not None else []:
        if node.op == "Slice" and node.outputs and id(node.outputs[0]) in outputs:
            use = _attention_use(concat.outputs[0])
            softmaxes = [n for n in graph.nodes if n.op == "Softmax" or n.op in ATTENTION_OPS]
            layer = f"layer {softmaxes.index(use[1])} attention: " if use is not None and use[1] in softmaxes else ""
            raise InputError(f"{layer}cache input '{escape(past.name)}': its present '{escape(node.outputs[0].name)}' keeps "
                             f"only the last entries of Concat '{escape(concat.name)}' (a sliding-window layer's "
                             "cropped cache, transformers' DynamicSlidingWindowLayer); mtkc keeps a static cache "
                             "of --cache-len entries and masks the window: export without cache I/O and compile "
                             "with --kv-cache, or with transformers' exporter (its presents keep every entry)")


def layer_caches(graph: gs.Graph) -> list[LayerCache]:
    """The per-layer cache concats of a graph already through `kv-cache` (inputs past_<kv>_<i>)."""
    layers: dict[int, LayerCache] = {}
    for past in graph.inputs:
        m = _CONTRACT.match(past.name)
        if not m:
            continue
        concat = cache_concat(past)
        if concat is None:
            raise InputError(f"cache input '{past.name}': no Concat(past, new, axis=2) consumes it")
        layer = layers.setdefault(int(m["i"]), LayerCache(int(m["i"]), {}, {}))
        layer.past[m["kind"]], layer.concat[m["kind"]] = past, concat
    return [layers[i] for i in sorted(layers)]
