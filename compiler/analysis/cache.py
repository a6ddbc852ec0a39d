"""Finding the KV cache by structure, whatever the exporter named it.

A cache input is a rank-4 graph input that reaches, through copies (Identity, 1-input Concat, the
Q/DQ pairs a static QDQ model puts on every activation), `Concat(past, new, axis=2)` whose result
is a graph output (the present), directly or through a Q/DQ pair: `kv-cache` makes the Concat's
result the output, so the cache I/O of a QDQ model is float, as the converter's calibration expects.
Its layer and kind are the DecoderMap's (`mtkc.analysis.decoder`): the layer whose key or value
path appends to it (`Layer.past`, `Layer.cache`), numbered as the map numbers layers. A cache input
no recognised layer appends to is refused with the map's reason for the layer it sits in.
After `kv-cache` the inputs carry contract names (`past_key_<i>`), read by `layer_caches`.

Also here, as the kv-cache passes and bind-shapes both need them: each cache input's kv heads and
head dim (`cache_head_dims`: from the entries appended to it, in a shape probe with the symbolic
dims set, or from the GroupQueryAttention reading it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import QDQ, DecoderMap, decoder_map, present_of
from mtkc.contract import io as contract_io
from mtkc.ir import shapes
from mtkc.ir.graph_utils import static_shape, tensor_map
from mtkc.display import escape
from mtkc.errors import InputError, InternalError

KINDS = contract_io.KINDS
PROBE_START = 97  # the first sequence length a shape probe tries (`probe_length`)
SMALL = 64  # integer constants up to this many elements are read for their values (shapes, axes)
MS = "com.microsoft"
_COPIES = ("Identity", *sorted(QDQ))


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


def find_caches(graph: gs.Graph, dm: DecoderMap | None = None) -> list[LayerCache]:
    """Every layer's cache I/O (see the module docstring); [] when there is none. `dm`: the graph's
    DecoderMap (`ctx.analysis(decoder_map, graph)`), computed when not given.

    A cache input no recognised layer appends to is refused (InputError) with the DecoderMap's reason
    for the candidate layer nearest its Concat, or, when every candidate is a layer, with that layer named."""
    dm = dm or decoder_map(graph)
    claimed: dict[str, tuple[int, str]] = {}  # cache input -> (layer, kind) from the map
    for layer in dm.layers:
        for kind, past in layer.past.items():
            claimed[past] = (layer.index, kind)
    found: dict[int, dict[str, tuple[gs.Variable, gs.Node]]] = {}
    outputs = {id(t) for t in graph.outputs}
    for tensor in graph.inputs:
        if tensor.shape is not None and len(tensor.shape) != 4:
            continue
        concat = cache_concat(tensor)
        if concat is None or present_of(concat, outputs) is None:
            _refuse_cropped(dm, tensor, outputs)
            continue
        index, kind = claimed.get(tensor.name, (None, None))
        if index is None or dm.layers[index].cache.get(kind) != concat.name:
            raise InputError(_unclaimed(dm, tensor, concat))
        found.setdefault(index, {})[kind] = (tensor, concat)
    layers = []
    for index in sorted(found):
        slot = found[index]
        missing = [k for k in KINDS if k not in slot]
        if missing:
            have = next(iter(slot.values()))[0].name
            raise InputError(f"cache input '{escape(have)}' has no matching past {missing[0]} input "
                             f"(decoder layer {index}, '{escape(dm.layers[index].anchor)}')")
        layers.append(LayerCache(index, {k: slot[k][0] for k in KINDS}, {k: slot[k][1] for k in KINDS}))
    if layers and [x.index for x in layers] != list(range(len(dm.layers))):
        bare = next(x for x in dm.layers if x.index not in found)
        raise InputError(f"decoder layer {bare.index} ('{escape(bare.anchor)}') appends to no cache input while "
                         f"{len(layers)} other layers do")
    return layers


def _unclaimed(dm: DecoderMap, past: gs.Tensor, concat: gs.Node) -> str:
    """Why a cache input is in no recognised layer: the refusal of the candidate its Concat feeds."""
    head = f"cache input '{escape(past.name)}' (Concat '{escape(concat.name)}')"
    near = _attention_of(concat, {x.anchor: x for x in dm.layers + dm.refused})
    if near is not None and near.refused:
        return f"{near.refusal()}; so {head} has no layer to belong to"
    if near is not None:
        return f"{head} is neither the key nor the value cache of decoder layer {near.index} ('{escape(near.anchor)}')"
    return f"{head} is in none of the {len(dm.layers)} decoder layers found ({dm.summary()})"


def _attention_of(concat: gs.Node, anchors: dict):
    """The candidate layer a cache Concat feeds, whatever ops lie between: the anchor below the first
    MatMul its result reaches (a key's scores), else above that MatMul's other operand (a value's PV,
    back along the probabilities)."""
    matmul = next((n for n in _walk(concat, down=True) if n.name in anchors or n.op in ("MatMul", "Gemm")), None)
    if matmul is None or matmul.name in anchors:
        return anchors.get(matmul.name) if matmul is not None else None
    probabilities = matmul.inputs[0].inputs[0] if matmul.inputs[0].inputs else None
    for start, down in ((probabilities, False), (matmul, True)):
        found = next((n for n in _walk(start, down) if n.name in anchors), None) if start is not None else None
        if found is not None:
            return anchors[found.name]
    return None


def _walk(node: gs.Node, down: bool, reach: int = 64):
    """`node` and the nodes below (`down`) or above it, breadth first along data edges (not Shape/Size),
    not past a MatMul/Gemm (a projection or the other attention product), within `reach` nodes."""
    frontier, seen = [node], {id(node)}
    while frontier and len(seen) < reach:
        following = []
        for n in frontier:
            yield n
            if n is not node and n.op in ("MatMul", "Gemm"):
                continue
            near = [m for t in n.outputs for m in t.outputs] if down else [t.inputs[0] for t in n.inputs if t.inputs]
            for m in near:
                if id(m) not in seen and m.op not in ("Shape", "Size"):
                    seen.add(id(m))
                    following.append(m)
        frontier = following


def _refuse_cropped(dm: DecoderMap, past: gs.Tensor, outputs: set[int]) -> None:
    """A present that is the concat's last entries only (`Slice(concat, -W+1:)` on the sequence axis,
    the past sliced the same way: transformers' DynamicSlidingWindowLayer of sliding-window layers)
    is a cache mtkc cannot make static as exported: refused with the layer's tensors named and the
    way that works."""
    concat = cache_concat(past, _COPIES + ("Slice",))
    for node in concat.outputs[0].outputs if concat is not None else []:
        if node.op == "Slice" and node.outputs and id(node.outputs[0]) in outputs:
            near = _attention_of(concat, {x.anchor: x for x in dm.layers + dm.refused})
            layer = f"layer {near.index} attention: " if near is not None else ""
            raise InputError(f"{layer}cache input '{escape(past.name)}': its present '{escape(node.outputs[0].name)}' keeps "
                             f"only the last entries of Concat '{escape(concat.name)}' (a sliding-window layer's "
                             "cropped cache, transformers' DynamicSlidingWindowLayer); mtkc keeps a static cache "
                             "of --cache-len entries and masks the window: export without cache I/O and compile "
                             "with --kv-cache, or with transformers' exporter (its presents keep every entry)")


def layer_caches(graph: gs.Graph, dm: DecoderMap) -> list[LayerCache]:
    """The DecoderMap's layers with their cache I/O, in a graph already through `kv-cache`: layer i
    must read `past_<kind>_<i>` (one numbering for the map, the contract names and `--chunks`)."""
    inputs = {t.name: t for t in graph.inputs}
    layers = []
    for layer in dm.layers:
        want = {kind: f"past_{kind}_{layer.index}" for kind in KINDS}
        if layer.past != want or set(layer.cache) != set(KINDS):
            raise InputError(f"decoder layer {layer.index} ('{escape(layer.anchor)}') reads cache inputs "
                             f"{layer.past}, expected {want}")
        layers.append(LayerCache(layer.index, {k: inputs[want[k]] for k in KINDS},
                                 {k: layer.nodes[layer.cache[k]] for k in KINDS}))
    read = {p.name for x in layers for p in x.past.values()}
    unread = [name for name in inputs if name not in read and (contract_io.cache_name(name) or ("",))[0] == "past"]
    if unread:  # the pipeline's own graph: a map that lost a layer is mtkc's bug, never a silent no-op
        why = f": {dm.refused[0].refusal()}" if dm.refused else ""
        raise InternalError(f"cache input '{unread[0]}' is in none of the {len(layers)} decoder layers the "
                            f"DecoderMap finds in the rewritten graph{why}")
    return layers


# -- cache head dims ------------------------------------------------------------------------------
def cache_head_dims(graph: gs.Graph, pasts: list[tuple[gs.Variable, gs.Node]], root=None) -> dict[str, tuple[int, int]]:
    """{cache input name: (kv heads, head dim)}, found by structure whatever the exporter called the
    dims (dynamo's `s35`, onnxruntime-genai's `kv_cache_dim`): from the shape of the entries each
    (past, Concat) of `pasts` appends (`find_caches`' layers, or `appended_caches`), or from the
    GroupQueryAttention that consumes it."""

    found = dict(gqa_caches(graph))
    if not pasts:
        return found
    probe, _ = probe_shapes(graph, root, keep={id(p) for p, _ in pasts})
    for past, concat in pasts:
        shape = probe.get(concat.inputs[1].name)
        if shape is not None and len(shape) == 4 and all(isinstance(shape[a], int) for a in (1, 3)):
            found[past.name] = (shape[1], shape[3])
    return found


def appended_caches(graph: gs.Graph) -> list[tuple[gs.Variable, gs.Node]]:
    """(input, Concat) of every rank-4 graph input a Concat appends to, whichever layer (if any) it
    belongs to: for binding its dims, which a cache the decoder analysis refused needs too."""
    pairs = []
    for t in graph.inputs:
        concat = cache_concat(t) if len(t.shape or ()) == 4 else None
        if concat is not None and len(concat.inputs) == 2:
            pairs.append((t, concat))
    return pairs


def layer_pasts(layers: list[LayerCache]) -> list[tuple[gs.Variable, gs.Node]]:
    return [(layer.past[k], layer.concat[k]) for layer in layers for k in KINDS]


def probe_length(graph: gs.Graph, start: int = PROBE_START) -> int:
    """The sequence length of a shape probe: the smallest from `start` that is no static dim of any
    tensor (inputs, value infos, initializers: their dims are in the proto) and no value of a small
    integer constant (Reshape/Expand shapes, heads). A dim only inference finds (a Reshape's -1) may
    still equal it: a second probe at another length tells them apart (`kv-cache`'s insert). No weight
    is read: only integer constants of at most SMALL elements."""
    taken = set()
    constants = [node.attrs["value"] for node in graph.nodes if node.op == "Constant" and "value" in node.attrs]
    for t in [*tensor_map(graph).values(), *constants]:
        taken.update(d for d in t.shape or () if isinstance(d, int))
        if isinstance(t, gs.Constant) and np.dtype(t.dtype).kind in "iu" and int(np.prod(t.shape)) <= SMALL:
            taken.update(int(v) for v in np.asarray(t.values).ravel())
    length = start
    while length in taken:
        length += 1
    return length


def probe_shapes(graph: gs.Graph, root=None, keep: set[int] = frozenset(),
                 start: int = PROBE_START) -> tuple[dict[str, list], int]:
    """(tensor shapes, the probe length S) with every symbolic input dim set to 1 (batch) or S =
    `probe_length(graph, start)` (the rest): static Hkv and D where symbolic inference leaves them unknown
    (TorchScript's runtime reshapes), and the sequence axis recognisable by its value. Inputs in
    `keep` (ids: cache inputs) have only their batch and length axes set; their other symbols stay unknown."""
    kept = {t.name for t in graph.inputs if id(t) in keep}
    length = probe_length(graph, start)
    probe = graph.copy()
    for t in probe.inputs:
        t.shape = [d if isinstance(d, int) or (t.name in kept and axis not in (0, 2))
                   else (1 if axis == 0 else length) for axis, d in enumerate(t.shape or [])]
        if contract_io.is_mask(t.name) and len(t.shape) == 4:  # additive, no past yet: [1, 1, S, S]
            t.shape = [1, 1, length, length]
    shapes.infer(probe, root)
    return {name: t.shape for name, t in tensor_map(probe).items()}, length


# -- GroupQueryAttention's cache (its attributes and inputs) -------------------------------------
def op_input(node: gs.Node, i: int) -> gs.Tensor | None:
    """Input `i` of `node`, None when absent or empty (an optional input left out)."""
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def gqa_head_size(node: gs.Node, heads: int, kv_heads: int) -> int | None:
    """D from a per-head input, the (packed) query's width, else the cos cache ([max, R/2], R = D
    unless the rotary is partial, as Phi-2's)."""
    for i, n in ((3, None), (1, kv_heads), (0, heads + (2 * kv_heads if op_input(node, 1) is None else 0))):
        width = last_width(op_input(node, i)) if op_input(node, i) is not None else None
        if width:
            return width if n is None else width // n
    cos = op_input(node, 7)
    if node.attrs.get("do_rotary", 0) and cos is not None and rope_table_width(cos):
        return 2 * rope_table_width(cos)
    return None


def rope_table_width(cos: gs.Tensor) -> int | None:
    """The cos cache's width R/2: its static shape's, or the If's branch constants' (the builder's
    long/short RoPE switch, `[max_sequence_length, 'head_dim / 2']` as declared)."""
    shape = static_shape(cos)
    if shape:
        return shape[1]
    node = cos.inputs[0] if cos.inputs else None
    if node is None or node.op != "If":
        return None
    out = node.outputs.index(cos)
    widths = set()
    for branch in (node.attrs.get("then_branch"), node.attrs.get("else_branch")):
        made = branch.outputs[out].inputs[0] if branch is not None and branch.outputs[out].inputs else None
        value = made.attrs.get("value") if made is not None and made.op == "Constant" else None
        widths.add(value.shape[1] if isinstance(value, gs.Constant) and len(value.shape) == 2 else None)
    return widths.pop() if len(widths) == 1 else None


def last_width(t: gs.Tensor) -> int | None:
    """The last dim of `t`: its static shape's, or its MatMul / MatMulNBits (/Add bias) projection's."""
    if t.shape and isinstance(t.shape[-1], int) and t.shape[-1] > 0:
        return t.shape[-1]
    node = t.inputs[0] if t.inputs else None
    for _ in range(2):
        if node is not None and node.op == "MatMulNBits" and node.attrs.get("N"):
            return int(node.attrs["N"])  # int4: the weight's output width is the op's attribute
        if node is None or node.op not in ("MatMul", "Add"):
            return None
        const = next((x for x in node.inputs if isinstance(x, gs.Constant)), None)
        if node.op == "MatMul" and const is not None and len(const.shape) == 2:
            return int(const.shape[1])
        other = next((x for x in node.inputs if not isinstance(x, gs.Constant)), None)
        node = other.inputs[0] if other is not None and other.inputs else None
    return None


def gqa_caches(graph: gs.Graph) -> dict[str, tuple[int, int]]:
    """{past_key / past_value input name: (kv heads, head dim)} of every GroupQueryAttention."""
    found = {}
    for node in graph.nodes:
        if node.op == "GroupQueryAttention" and node.domain == MS:
            heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
            d = gqa_head_size(node, heads, kv_heads)
            for i in (3, 4):
                past = op_input(node, i)
                if d and past is not None and past in graph.inputs:
                    found[past.name] = (kv_heads, d)
    return found
