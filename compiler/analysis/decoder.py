"""DecoderMap: one picture of a decoder-only LLM graph, found by structure, not by names.

Anchored on attention: every Softmax and every fused attention op (com.microsoft Attention /
MultiHeadAttention / GroupQueryAttention / PackedAttention, opset-23 Attention) is a candidate
layer, numbered in graph order. Around a Softmax anchor:

    q_proj ─[layout, RoPE, scale]─┐
    k_proj ─[layout, RoPE, cache Concat(past, ·, axis 2), repeat]─ Transpose ─┴─ MatMul (scores)
        ─[scale Mul/Div][soft-cap Div·Tanh·Mul][mask Add/Where]─ Softmax ─[Cast, Where]─ MatMul (PV)
    v_proj ─[layout, cache Concat, repeat]──────────────────────────────────────────────┘
    PV ─[layout]─ o_proj ─[bias]─ Add (residual) ─ post norm ─ MLP ─ Add (residual out)

A candidate whose scores, PV or projections are not where the picture has them is a per-layer
`refused` reason (a classifier Softmax, an op this map does not know), never an exception.
Globally: the token input, the embedding (and its scale), the final norm, the logits (and a
final soft-cap), the mask and position sources, the cache layout.

Cheap by construction: each walk is bounded (`REACH` nodes), nothing reads a weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.constants import constant_of
from mtkc.ir.graph_utils import dtype_of

REACH = 32  # nodes one bounded walk may visit
FUSED_ATTENTION = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"}
PROJECTIONS = {"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "MatMulInteger", "DynamicQuantizeMatMul"}
NORMS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization",
         "LayerNormalization", "SkipLayerNormalization"}
QDQ = {"QuantizeLinear", "DequantizeLinear"}  # a QDQ model's activations, transparent to the structure
_SCORE_PATH = {"Add", "Where", "Mul", "Div", "Tanh", "Cast", "Sub", "Identity", "Reshape", *QDQ}
_PROB_PATH = {"Cast", "Where", "IsNaN", "Identity", "Dropout", "Reshape", *QDQ}
_LAYOUT = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Tile", "Concat",
           "Mul", "Div", "Add", "Sub", "Neg", "Slice", "Split", "RotaryEmbedding", "Gather",
           "DequantizeLinear", "QuantizeLinear", *NORMS}  # NORMS: a q/k norm as one op (Qwen3, Gemma 3)
_ALL_INPUTS = {"Concat", "Mul", "Div", "Add", "Sub", "RotaryEmbedding"}  # other layout ops: data input 0 only
_OUT_PATH = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Where"}
_GLU = {"Sigmoid": "SwiGLU", "QuickGelu": "SwiGLU", "Swish": "SwiGLU", "Erf": "GeGLU", "Gelu": "GeGLU",
        "FastGelu": "GeGLU", "BiasGelu": "GeGLU", "Tanh": "GeGLU"}
MASK_NAMES = ("attention_mask",)


@dataclass
class Layer:
    """One decoder layer. Node fields hold node names (None: not in this graph)."""

    index: int
    anchor: str  # the Softmax or fused attention node
    position: int = 0  # rank among all candidates (recognised and refused), in graph order
    attention: str = ""  # "softmax" | the fused op type
    q: str | None = None
    k: str | None = None
    v: str | None = None
    fused_qkv: bool = False
    qk_norm: bool = False  # a norm on the query after its projection
    rope: str | None = None  # the rotation on q ("fused" inside the attention op)
    partial_rotary: bool = False  # RoPE on the first dims of each head only (Phi-4-mini)
    scores: str | None = None
    scale: str | None = None
    softcap: str | None = None
    mask: str | None = None  # the Add/Where putting the mask on the scores
    softmax: str | None = None
    pv: str | None = None
    cache: dict[str, str] = field(default_factory=dict)  # kind -> Concat(past, new) or the attention op
    past: dict[str, str] = field(default_factory=dict)  # kind -> graph input
    window: int | None = None  # sliding window, when the graph shows one (GroupQueryAttention local_window_size)
    residual_in: str | None = None  # tensors
    residual_out: str | None = None  # None also when the sum lives only inside the next Skip norm
    norms: list[str] = field(default_factory=list)  # input norm, post-attention norm
    mlp: str | None = None  # SwiGLU | GeGLU | GELU | SiLU | None (not recognised)
    fused_gate_up: bool = False
    refused: str | None = None
    block: str | None = None  # the part a refusal is about: scores | probabilities | projections
    nodes: dict[str, gs.Node] = field(default_factory=dict, repr=False, compare=False)  # name -> node, for passes

    @property
    def kind(self) -> str:
        return f"{'attention' if self.attention == 'softmax' else self.attention}+{self.mlp or '?'}"

    def blocks(self) -> str:
        """What was recognised, compactly ("2 norms, q/k/v, rope, sdpa, cache, SwiGLU"), or the refusal."""
        if self.refused:
            return f"{self.block} refused: {self.refused}"
        rope = ("partial rope" if self.partial_rotary else "rope (in the op)" if self.rope == "fused" else "rope") \
            if self.rope else "no rope"
        parts = [f"{len(self.norms)} norms" + (" (sandwich)" if len(self.norms) >= 4 else ""),
                 "fused qkv" if self.fused_qkv else "q/k/v", "q/k norm" if self.qk_norm else "", rope,
                 "sdpa" if self.attention == "softmax" else self.attention, "soft-cap" if self.softcap else "",
                 f"window {self.window}" if self.window else "", "cache" if self.cache else "",
                 (self.mlp or "MLP not recognised") + (" (fused gate-up)" if self.fused_gate_up else "")]
        return ", ".join(p for p in parts if p)

    def refusal(self) -> str:
        """One line naming a refused candidate, its block and the reason (for errors and `check`)."""
        return f"decoder layer {self.index} ('{self.anchor}'): {self.block} refused: {self.refused}"

    def to_json(self) -> dict:
        if self.refused:
            return {"index": self.index, "anchor": self.anchor, "block": self.block, "refused": self.refused}
        return {k: v for k, v in self.__dict__.items() if k not in ("nodes", "position")
                and v not in (None, [], {}, False)} | {"kind": self.kind}


@dataclass
class DecoderMap:
    layers: list[Layer] = field(default_factory=list)  # recognised ones, numbered 0..N-1
    refused: list[Layer] = field(default_factory=list)  # candidates that are not a decoder layer, numbered by
    # their rank among all candidates (the layer they would be when every earlier candidate is one)
    token_input: str | None = None
    embedding: str | None = None
    embedding_scale: str | None = None
    final_norm: str | None = None
    logits: str | None = None
    final_softcap: str | None = None
    mask_source: str | None = None
    position_source: str | None = None
    cache_layout: str = "none"
    family: str | None = None  # recognised from structure (`_family`); None without layers

    def to_json(self) -> dict:
        glob = {k: v for k, v in self.__dict__.items() if k not in ("layers", "refused")}
        return {"layers": len(self.layers), "kinds": sorted({layer.kind for layer in self.layers}),
                **glob, "per_layer": [layer.to_json() for layer in self.layers],
                "refused": [layer.to_json() for layer in self.refused]}

    @property
    def cached(self) -> bool:
        """Whether the graph has a KV cache: a layer whose key or value path reads a past input."""
        return any(layer.past for layer in self.layers)

    def summary(self) -> str:
        kinds = ", ".join(f"{sum(x.kind == k for x in self.layers)}×{k}" for k in sorted({x.kind for x in self.layers}))
        text = f"{self.family + ', ' if self.family else ''}{len(self.layers)} layers ({kinds or 'none'}); " \
               f"cache {self.cache_layout}"
        return text + (f"; {len(self.refused)} refused" if self.refused else "")

    def per_layer(self) -> list[str]:
        """One line per run of identical layers, in graph order ("layers 0-23: ...", "layer 3: scores refused: ...")."""
        runs: list[list] = []
        for layer in sorted(self.layers + self.refused, key=lambda x: x.position):
            text = layer.blocks()
            if runs and runs[-1][2] == text and not layer.refused:
                runs[-1][1] = layer.position
            else:
                runs.append([layer.position, layer.position, text])
        return [f"layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {text}" for a, b, text in runs]

    def contract_names(self, graph: gs.Graph) -> dict[str, str]:
        """{export's name: contract name} of the cache inputs, presents and logits, for the layers whose
        cache is `Concat(past, new, axis 2)` into a graph output (what `kv-cache` names; verify pairs
        an export's own I/O with the compiled graph's by it)."""
        names, outputs = {}, {id(t) for t in graph.outputs}
        for layer in self.layers:
            concats = {k: layer.nodes.get(layer.cache.get(k)) for k in ("key", "value")}
            presents = {k: present_of(c, outputs) for k, c in concats.items() if c is not None and c.op == "Concat"}
            if len(presents) != 2 or any(p is None for p in presents.values()) or set(layer.past) != {"key", "value"}:
                continue
            for kind, present in presents.items():
                names[layer.past[kind]] = f"past_{kind}_{layer.index}"
                names[present.name] = f"present_{kind}_{layer.index}"
        rest = [o.name for o in graph.outputs if o.name not in names]
        if names and rest and "logits" not in rest:
            names[rest[0]] = "logits"
        return names


def present_of(concat: gs.Node, outputs: set[int]) -> gs.Tensor | None:
    """The graph output (`outputs`: the ids of the graph's outputs) a cache Concat's result is:
    itself, or its QuantizeLinear -> DequantizeLinear (a QDQ model)."""
    tensor = concat.outputs[0]
    for _ in range(3):
        if id(tensor) in outputs:
            return tensor
        nxt = [n for n in tensor.outputs if n.op in QDQ]
        if not nxt:
            return None
        tensor = nxt[0].outputs[0]
    return None


class Refused(Exception):
    def __init__(self, block: str, reason: str) -> None:
        super().__init__(reason)
        self.block = block


def decoder_map(graph: gs.Graph) -> DecoderMap:
    """The DecoderMap of `graph` (see the module docstring)."""
    dm = DecoderMap()
    inputs = {id(t) for t in graph.inputs}
    for node in graph.nodes:
        fused = node.op in FUSED_ATTENTION and (node.domain == "com.microsoft" or node.op == "Attention")
        if node.op != "Softmax" and not fused:
            continue
        layer = Layer(len(dm.layers), node.name, len(dm.layers) + len(dm.refused))
        try:
            (_fused(layer, node, inputs) if fused else _softmax(layer, node, inputs))
            _block(layer, node if fused else layer.nodes[layer.pv])
        except Refused as why:
            layer.refused, layer.block, layer.nodes, layer.index = str(why), why.block, {}, layer.position
            dm.refused.append(layer)
            continue
        dm.layers.append(layer)
    _globals(dm, graph)
    dm.family = _family(dm, any(n.domain == "com.microsoft" for n in graph.nodes))
    return dm


def _family(dm: DecoderMap, exporter_fused: bool) -> str | None:
    """The model family the layers' structure says, "decoder (unknown family)" when it says none.
    `exporter_fused`: com.microsoft ops present (onnxruntime's optimiser, the genai builder), which
    pack q/k/v and gate/up whatever the family, so packing is no evidence there."""
    if not dm.layers:
        return None
    has = lambda name: any(getattr(x, name) for x in dm.layers)  # noqa: E731
    mlps = {x.mlp for x in dm.layers}
    if has("softcap") and "SwiGLU" not in mlps:
        return "Gemma 2"  # attention soft-cap (with GeGLU and sandwich norms)
    if has("qk_norm"):
        return {"GeGLU": "Gemma 3", "SwiGLU": "Qwen3"}.get(" ".join(sorted(m or "" for m in mlps)),
                                                          "decoder (unknown family)")
    if mlps != {"SwiGLU"} or has("fused_qkv") and exporter_fused:
        return "decoder (unknown family)"
    if has("fused_qkv"):
        return "Phi-4-mini" if has("partial_rotary") else "Phi-3/Phi-3.5"
    return "Qwen2/Llama-style"


# -- attention ------------------------------------------------------------------------------------
def _producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if isinstance(t, gs.Variable) and t.inputs else None


def _remember(layer: Layer, node: gs.Node) -> str:
    layer.nodes[node.name] = node
    return node.name


def _softmax(layer: Layer, softmax: gs.Node, inputs: set[int]) -> None:
    layer.attention, layer.softmax = "softmax", softmax.name
    t = softmax.inputs[0]
    for _ in range(REACH):  # up to the scores MatMul
        node = _producer(t)
        if node is None:
            raise Refused("scores", f"Softmax '{softmax.name}': its input '{t.name}' is not computed from a "
                          "MatMul(Q, Kᵀ)")
        if node.op == "MatMul":
            break
        if node.op not in _SCORE_PATH:
            raise Refused("scores", f"Softmax '{softmax.name}': {node.op} '{node.name}' between the scores and the "
                          "Softmax (expected MatMul(Q, Kᵀ) through scale, soft-cap, mask)")
        variable = [x for x in node.inputs if constant_of(x) is None]
        if node.op == "Tanh":
            layer.softcap = node.name
        elif node.op in ("Add", "Where") and len(variable) >= 2:
            layer.mask = layer.mask or node.name
        elif node.op in ("Mul", "Div") and len(variable) == 1 and layer.scale is None and layer.softcap is None \
                and (_producer(variable[0]) or node).op != "Tanh":  # (cap * tanh(·): the soft-cap's)
            layer.scale = node.name
        t = node.inputs[1] if node.op == "Where" else next((x for x in node.inputs if _producer(x) is not None
                                                             and _from_matmul(x)), node.inputs[0])
    else:
        raise Refused("scores", f"Softmax '{softmax.name}': no MatMul(Q, Kᵀ) within {REACH} nodes above it")
    scores = node
    layer.scores = _remember(layer, scores)
    t, pv = softmax.outputs[0], None
    for _ in range(REACH):  # down to the PV MatMul
        users = t.outputs
        pv = next((u for u in users if u.op == "MatMul" and u.inputs[0] is t), None)
        step = next((u for u in users if u.op in _PROB_PATH), None)
        if pv is not None or step is None:
            break
        t = step.outputs[0]
    if pv is None:
        raise Refused("probabilities", f"Softmax '{softmax.name}': its probabilities reach no MatMul(P, V)")
    layer.pv = _remember(layer, pv)
    layer.q, _, rope = _projection(scores.inputs[0], inputs, layer)
    layer.rope = rope
    layer.k, _, _ = _projection(scores.inputs[1], inputs, layer, "key")
    layer.v, _, _ = _projection(pv.inputs[1], inputs, layer, "value")
    if not (layer.q and layer.k and layer.v):
        missing = [k for k in "qkv" if not getattr(layer, k)]
        raise Refused("projections", f"Softmax '{softmax.name}': no {'/'.join(missing)} projection (a MatMul of "
                      f"a weight) within {REACH} nodes above its scores")
    layer.fused_qkv = layer.q == layer.k == layer.v


def _from_matmul(t: gs.Tensor) -> bool:
    """The scores branch of an Add/Mul: a MatMul output a few score-path ops up (not the mask)."""
    for _ in range(6):
        node = _producer(t)
        if node is None:
            return False
        if node.op == "MatMul":
            return True
        if node.op not in _SCORE_PATH:
            return False
        t = node.inputs[1] if node.op == "Where" else node.inputs[0]
    return False


def _weight(node: gs.Node) -> bool:
    if node.op not in PROJECTIONS or len(node.inputs) < 2:
        return False
    return node.op != "MatMul" or _from_constants(node.inputs[1])


def _from_constants(t: gs.Tensor, budget: int = 12) -> bool:
    """`t` is computed from constants alone within `budget` nodes (a weight, or its dequantise
    subgraph: int4-weights' Cast · Sub · Mul · Reshape of int8 codes and block scales)."""
    stack, seen = [t], 0
    while stack:
        x = stack.pop()
        if constant_of(x) is not None:
            continue
        node = _producer(x)
        seen += 1
        if node is None or seen > budget:
            return False
        stack += list(node.inputs)
    return True


def _projection(t: gs.Tensor, inputs: set[int], layer: Layer, kind: str | None = None):
    """(projection node name, its input, RoPE node) above `t`, breadth first within REACH nodes;
    records the cache concat of `kind` on the way."""
    frontier, seen, rope, qdq = [t], set(), None, 0
    while frontier and len(seen) - qdq < REACH:  # a QDQ model's Q/DQ pairs do not count
        following = []
        for x in frontier:
            if kind and id(x) in inputs and kind not in layer.past and len(x.shape or [0] * 4) == 4:
                layer.past[kind] = x.name
            node = _producer(x)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            qdq += node.op in QDQ
            if _weight(node):
                return _remember(layer, node), node.inputs[0], rope
            if kind is None and _is_norm(node):  # the query's own norm (Qwen3, Gemma 3)
                layer.qk_norm = True
            if node.op not in _LAYOUT:
                continue
            if _rotated(node):
                rope = rope or node.name
            if kind is None and node.op == "Concat" and node.attrs.get("axis") in (-1, 3) \
                    and any(_rotated(_producer(i)) for i in node.inputs):  # cat(rope(q[..., :r]), q[..., r:])
                layer.partial_rotary |= any(not _rotated(_producer(i)) and _last_dim(i) > 0 for i in node.inputs)
            if kind and node.op == "Concat" and len(node.inputs) == 2 and node.attrs.get("axis") in (2, -2):
                layer.cache.setdefault(kind, _remember(layer, node))
            data = node.inputs if node.op in _ALL_INPUTS else node.inputs[:1]
            following += [i for i in data if constant_of(i) is None]
        frontier = following
    return None, None, rope


def _rotated(node: gs.Node | None) -> bool:
    """A RoPE rotation: RotaryEmbedding, or x·cos ± rotate_half(x)·sin (an Add/Sub of two Muls)."""
    return node is not None and (node.op == "RotaryEmbedding" or node.op in ("Add", "Sub") and all(
        (_producer(i) or gs.Node("")).op == "Mul" for i in node.inputs))


def _last_dim(t: gs.Tensor) -> int:
    """The static last dim of `t`, -1 when not known (a TorchScript export declares few shapes)."""
    return t.shape[-1] if t.shape and isinstance(t.shape[-1], int) else -1


def _is_norm(node: gs.Node) -> bool:
    """A norm op, or the 1/sqrt(mean(x²) + eps) of a decomposed RMSNorm/LayerNorm."""
    if node.op in NORMS:
        return True
    up = _producer(node.inputs[0]) if node.op in ("Sqrt", "Reciprocal") else None
    for _ in range(3):
        if up is None or up.op not in ("ReduceMean", "Add", "Sqrt", "Cast"):
            return False
        if up.op == "ReduceMean":
            return True
        up = _producer(next((x for x in up.inputs if constant_of(x) is None), up.inputs[0]))
    return False


def _fused(layer: Layer, node: gs.Node, inputs: set[int]) -> None:
    layer.attention = node.op
    for kind, i in (("q", 0), ("k", 1), ("v", 2)):
        if len(node.inputs) > i and node.inputs[i].name:
            name, _, rope = _projection(node.inputs[i], inputs, layer, {"k": "key", "v": "value"}.get(kind))
            setattr(layer, kind, name)
            if kind == "q":
                layer.rope = "fused" if node.attrs.get("do_rotary") else rope
    if node.op == "GroupQueryAttention" and layer.q and not layer.k:
        layer.k = layer.v = layer.q  # packed QKV
    layer.fused_qkv = layer.q is not None and layer.q == layer.k == layer.v
    slots = {"GroupQueryAttention": (3, 4), "MultiHeadAttention": (6, 7)}.get(node.op)
    for kind, i in zip(("key", "value"), slots or ()):
        if len(node.inputs) > i and node.inputs[i].name:
            layer.cache[kind], layer.past[kind] = node.name, node.inputs[i].name
    window = int(node.attrs.get("local_window_size", -1))
    layer.window = window if window > 0 else None
    if float(node.attrs.get("softcap", 0.0)) > 0:
        layer.softcap = node.name
    if not layer.q:
        raise Refused("projections", f"{node.op} '{node.name}': no query projection (a MatMul of a weight) above it")


# -- residual stream and MLP -----------------------------------------------------------------------
def _block(layer: Layer, attention_out: gs.Node) -> None:
    """Residual in/out, norms and MLP kind, from the attention output down to the next residual add."""
    q = layer.nodes.get(layer.q)
    if q is not None and _producer(q.inputs[0]) is not None:
        norm = _producer(q.inputs[0])
        layer.norms.append(norm.name)
    t = attention_out.outputs[0]
    add = None
    for _ in range(8):  # PV ─[layout]─ o_proj ─[bias]─ residual Add | Skip norm
        users = [u for u in t.outputs]
        add = next((u for u in users if u.op == "Add" and all(constant_of(x) is None for x in u.inputs)
                    and not _weight(u)), None)
        skip = next((u for u in users if u.op in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")), None)
        if add is not None or skip is not None:
            break
        step = next((u for u in users if u.op in _OUT_PATH or _weight(u) or (u.op == "Add" and
                     any(constant_of(x) is not None for x in u.inputs))), None)
        if step is None:
            break
        t = step.outputs[0]
    if add is None and skip is None:  # a norm between o_proj and the residual add (Gemma's sandwich norms)
        add, t = _residual_add(attention_out)
        if add is None:
            return
        layer.norms.append(_producer(t).name)
    if add is not None:
        layer.residual_in = next(x.name for x in add.inputs if x is not t)
        mid, post_input = add.outputs[0], None
    else:
        layer.residual_in = next((x.name for x in skip.inputs[:2] if x is not t), None)
        if len(skip.outputs) < 4 or not skip.outputs[3].name:
            return
        mid, post_input = skip.outputs[3], skip.outputs[0]
        layer.norms.append(skip.name)
    post_mlp = None
    users = mid.outputs + [c for u in mid.outputs if u.op == "Cast" for c in u.outputs[0].outputs]  # legacy: a Cast
    out = next((u for u in users if u.op == "Add"), None)
    nxt = next((u for u in users if u.op in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")), None)
    if out is not None:
        layer.residual_out = out.outputs[0].name
        last = _producer(next((x for x in out.inputs if x is not mid and _producer(x) is not None), out.inputs[0]))
        while last is not None and last.op == "Cast":
            last = _producer(last.inputs[0])
        if last is not None and not _weight(last) and last.op != "Add":  # a post-MLP norm
            post_mlp = last.name
    elif nxt is not None and len(nxt.outputs) > 3 and nxt.outputs[3].name:
        layer.residual_out = nxt.outputs[3].name
    _mlp(layer, mid, post_input, out or nxt)
    if out is not None and post_mlp is not None and len(layer.norms) == 3:
        layer.norms.append(post_mlp)


def _residual_add(start: gs.Node) -> tuple[gs.Node | None, gs.Tensor | None]:
    """The first Add below `start` joining its branch with a tensor from outside it (the residual
    stream), breadth first along data edges within REACH nodes: (that Add, its input from the branch)."""
    below, frontier, seen = {id(t) for t in start.outputs}, list(start.outputs), 0
    while frontier and seen < REACH:
        t = frontier.pop(0)
        for u in t.outputs:
            seen += 1
            if u.op in ("Shape", "Size"):
                continue
            if u.op == "Add" and len(u.inputs) == 2 and all(constant_of(x) is None for x in u.inputs):
                other = u.inputs[1] if u.inputs[0] is t else u.inputs[0]
                if id(other) not in below and _producer(t) is not None:
                    return u, t
            for o in u.outputs:
                if id(o) not in below:
                    below.add(id(o))
                    frontier.append(o)
    return None, None


def _mlp(layer: Layer, mid: gs.Tensor, post: gs.Tensor | None, stop: gs.Node | None) -> None:
    """Kind of the MLP between the post-attention norm and the residual add `stop`."""
    if post is None:  # the post norm: the producer of the first weight MatMul below `mid`
        frontier, seen = [mid], 0
        while frontier and post is None and seen < REACH:
            t = frontier.pop(0)
            for u in t.outputs:
                seen += 1
                if u is stop:
                    continue
                if _weight(u):
                    post = u.inputs[0]
                    break
                frontier += u.outputs
        if post is None:
            return
        if _producer(post) is not None:
            layer.norms.append(_producer(post).name)
    ups = [u for u in post.outputs if _weight(u)]
    ops, frontier, seen = set(), [u.outputs[0] for u in ups if u.outputs], set()
    while frontier and len(seen) < REACH:
        t = frontier.pop(0)
        for u in t.outputs:
            if u is stop or id(u) in seen or _weight(u):
                continue
            seen.add(id(u))
            ops.add(u.op)
            frontier += u.outputs
    gated = len(ups) >= 2 or bool(ops & {"Split", "Slice"})
    layer.fused_gate_up = len(ups) == 1 and gated
    act = next((_GLU[op] for op in ("Sigmoid", "QuickGelu", "Swish", "Erf", "Gelu", "FastGelu", "BiasGelu", "Tanh")
                if op in ops), None)
    if act is None:
        return
    layer.mlp = act if gated else {"SwiGLU": "SiLU", "GeGLU": "GELU"}[act]


# -- global ---------------------------------------------------------------------------------------
def _globals(dm: DecoderMap, graph: gs.Graph) -> None:
    for t in graph.inputs:
        dtype = dtype_of(t)  # None for a type numpy has no name for (bfloat16 as graphsurgeon leaves it)
        lookup = next((u for u in t.outputs if u.op in ("Gather", "GatherBlockQuantized")
                       and u.inputs[1] is t), None)
        if lookup is not None and dtype is not None and dtype.kind in "iu":
            dm.token_input, dm.embedding = t.name, lookup.name
            scale = next((u for u in lookup.outputs[0].outputs if u.op == "Mul"
                          and any(constant_of(x) is not None for x in u.inputs)), None)
            dm.embedding_scale = scale.name if scale is not None else None
            break
    else:
        dm.token_input = next((t.name for t in graph.inputs if t.name in ("inputs_embeds", "hidden_states")), None)
    logits = next((o for o in graph.outputs if o.name == "logits"), graph.outputs[0] if graph.outputs else None)
    node = _producer(logits) if logits is not None else None
    for _ in range(6):  # [final soft-cap: Div · Tanh · Mul] above the lm_head
        if node is None or _weight(node):
            break
        if node.op == "Tanh":
            dm.final_softcap = node.name
        node = _producer(next((x for x in node.inputs if constant_of(x) is None), node.inputs[0]))
    if node is not None and _weight(node):
        dm.logits = node.name
        norm = _producer(node.inputs[0])
        dm.final_norm = norm.name if norm is not None else None
    names = {t.name for t in graph.inputs}
    mask = padding_mask(graph)
    dm.mask_source = next((n for n in MASK_NAMES if n in names), None) or (mask.name if mask is not None else None)
    dm.position_source = "position_ids" if "position_ids" in names else None
    if dm.layers and dm.layers[0].cache:
        first = dm.layers[0]
        fused = first.cache.get("key") == first.anchor
        past = next((t for t in graph.inputs if t.name == first.past.get("key")), None)
        shape = "[batch, kv_heads, past, head_dim]" if past is None or past.shape is None or len(past.shape) == 4 \
            else str(list(past.shape))
        dm.cache_layout = f"{shape} ({first.attention} past/present)" if fused else f"{shape} (Concat on axis 2)"


def padding_mask(graph: gs.Graph) -> gs.Variable | None:
    """The 2-D integer padding-mask input ([batch, total]: an exporter's `attention_mask`), else None."""
    return next((t for t in graph.inputs if "mask" in t.name and (dtype := dtype_of(t)) is not None
                 and np.issubdtype(dtype, np.integer) and t.shape is not None and len(t.shape) == 2), None)
