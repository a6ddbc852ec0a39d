"""Inserting a KV cache into an export without cache I/O (no-cache exports, `--kv-cache`).

`mask-early` has run (its additive [1,1,T,T] mask replaced the [B,1,T,T] construction),
K and V are cut where they enter attention (after RoPE, before repeat_kv),
`Concat(past, new, axis=2)` is inserted, the repeat_kv/Kᵀ shape targets are made length-free,
and RoPE reads a new `position_ids` input. The attentions are the DecoderMap's layers; refuses
(InputError) a layer the map refused, and a model with no Softmax attention (fused ops named).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap
from mtkc.errors import InputError
from mtkc.ir import shapes
from mtkc.ir.constants import values as values_of
from mtkc.ir.graph_utils import Names as NodeNames
from mtkc.analysis.cache import KINDS, LayerCache, probe_shapes

_LAYOUT = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Tile"}


def insert_cache(graph: gs.Graph, dm: DecoderMap, root=None) -> list[LayerCache]:
    """Cut K and V where they enter each attention and splice `Concat(past, new, axis=2)` in.

        MatMul(Q, ·Kᵀ) ─ [Add mask | Where | Mul] ─ Softmax ─ [Where | Cast]* ─ MatMul(·, V)
        K/V entry: walk up from the MatMul operand through layout ops (Transpose, Reshape,
        Expand, Unsqueeze -- repeat_kv --, Mul by a constant scale) to the first other producer
        (RoPE's Add for K) or to the head split Transpose(0,2,1,3) (V): [B, Hkv, S, D].

    Reshape/Expand targets between the concat and the MatMul (repeat_kv, Kᵀ) are rewritten to
    constants with the KV length free (-1 / broadcast 1): exporters compute them from the
    *query* length (dynamo, hf), which no longer equals the KV length.
    Positions: a no-cache export counts them from 0 (Range); the Range feeding cos/sin is
    replaced by a new `position_ids` input, so decode rows get their real position.
    The attentions are the DecoderMap's layers (`dm`, of `graph` as it is): a candidate it refused is
    refused here with its reason (its K/V would stay uncached, so decode would not see the past).
    """
    if dm.refused:
        raise InputError(f"{dm.refused[0].refusal()}; so kv-cache cannot tell where its K/V enter attention "
                         "to cache them (export with cache I/O, past_key_values, or without that op)")
    fused = sorted({x.attention for x in dm.layers if x.attention != "softmax"})
    if not dm.layers or fused:
        raise InputError(
            "model has no KV-cache inputs (past_key_values.*) and no attention (MatMul -> Softmax -> MatMul) "
            "whose K/V could be cut; cannot build prefill/decode graphs"
            + (f" (attention is fused as {', '.join(fused)}: export with cache I/O, or without ORT fusions)"
               if fused else ""))
    shapes.infer(graph, root)
    anchors = [(x.nodes[x.scores], x.nodes[x.pv]) for x in dm.layers]  # the attention MatMuls Q·Kᵀ, P·V
    sites = [(_kv_entry(qk.inputs[1]), _kv_entry(pv.inputs[1])) for qk, pv in anchors]
    probe, length = probe_shapes(graph, root)
    twice = any((probe.get(n.outputs[0].name) or []).count(length) > 1 for n in graph.nodes if n.op in ("Reshape", "Expand"))
    other = probe_shapes(graph, root, start=length + 1)[0] if twice else {}  # a dim inferred equal to `length`
    names = NodeNames(graph)
    layers = []
    for i, entries in enumerate(sites):
        layer = LayerCache(i, {}, {})
        for kind, new, matmul in zip(KINDS, entries, anchors[i]):
            shape = probe.get(new.name)
            if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1::2]):
                maker = new.inputs[0] if new.inputs else None
                made = f" (made by {maker.op} '{maker.name}')" if maker is not None else ""
                raise InputError(f"layer {i}: the {kind} entering attention at MatMul '{matmul.name}' is never a "
                                 f"per-head [B, Hkv, S, D] tensor: its layout ops lead back to '{new.name}' {shape}"
                                 f"{made}, so there is no {kind} to cache; export with cache I/O (past_key_values)"
                                 + _fused_entry(new))
            dtype = new.dtype or np.float32  # the entries' (fp16 exports: fp16)
            past = gs.Variable(f"past_{kind}_{i}", dtype, ["batch_size", shape[1], "past_sequence_length", shape[3]])
            full = gs.Variable(f"kv_cache/{kind}_{i}", dtype, None)
            concat = gs.Node("Concat", names.new(f"kv_cache/concat_{kind}_{i}"), {"axis": 2}, [past, new], [full])
            for node in list(new.outputs):
                if node is not concat:
                    for j, x in enumerate(node.inputs):
                        if x is new:
                            node.inputs[j] = full
            graph.nodes.append(concat)
            graph.inputs.append(past)
            _free_kv_length(full, (probe, length), other, names)
            layer.past[kind], layer.concat[kind] = past, concat
        layers.append(layer)
    position_input(graph, names, probe)
    return layers


def _free_kv_length(full: gs.Variable, probed: tuple[dict[str, list], int], other: dict[str, list],
                    names: NodeNames) -> None:
    """Make every Reshape/Expand from the cache concat to the attention MatMul length-agnostic
    (`probed`: the shapes at a sequence length; `other`: at another, when a dim may equal the first)."""
    probe, length = probed
    frontier = list(full.outputs)
    while frontier:
        node = frontier.pop()
        if node.op == "MatMul" or node.op not in _LAYOUT | {"Mul", "Div"}:
            continue
        out = probe.get(node.outputs[0].name)
        if node.op in ("Reshape", "Expand") and out is not None and all(isinstance(d, int) for d in out):
            second = other.get(node.outputs[0].name) or out
            axes = [a for a, d in enumerate(out) if d == length and (second is out or second[a] != d)]
            if len(axes) != 1:
                raise InputError(f"{node.name}: cannot tell the sequence axis of its output shape {out}")
            dims = [(-1 if node.op == "Reshape" else 1) if a in axes else d for a, d in enumerate(out)]
            node.inputs[1] = gs.Constant(names.new(f"{node.name}/kv_shape"), np.array(dims, np.int64))
            node.attrs.pop("allowzero", None)
        frontier += node.outputs[0].outputs


def _kv_entry(tensor: gs.Tensor) -> gs.Variable:
    for _ in range(16):
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or (node.op == "Transpose" and list(node.attrs.get("perm", [])) == [0, 2, 1, 3]):
            return tensor
        if node.op in _LAYOUT or (node.op in ("Mul", "Div") and _scalar(node.inputs[1])):
            tensor = node.inputs[0]
        elif node.op == "Mul" and _scalar(node.inputs[0]):
            tensor = node.inputs[1]
        else:
            return tensor
    return tensor


def _fused_entry(entry: gs.Tensor) -> str:
    """Why a K/V entry is not per-head: a contrib op (e.g. com.microsoft RotaryEmbedding) makes it
    on packed [B, S, Hkv*D] K/V, so there is no [B, Hkv, S, D] tensor to cut ('' otherwise)."""
    node = entry.inputs[0] if entry.inputs else None
    if node is None or node.domain in (None, "", "ai.onnx"):
        return ""
    return (f" (made by fused op {node.domain} {node.op} '{node.name}' on packed [B, S, Hkv*D] K/V: "
            "export with cache I/O, or without ORT fusions)")


def _scalar(tensor: gs.Tensor) -> bool:
    """A constant or a one-element tensor (a scale such as 1/sqrt(sqrt(D)))."""
    return isinstance(tensor, gs.Constant) or (tensor.shape is not None and all(d == 1 for d in tensor.shape))


def position_input(graph: gs.Graph, names: NodeNames, probe: dict[str, list]) -> None:
    """Feed cos/sin from a `position_ids [batch, seq]` input instead of Range(0, seq) -- or, in a
    cache export without a position input, Range(past, past + seq), which a static cache would fix at C.

    Only the rotary-only region (nodes whose every use leads to Cos/Sin) is rewired: the mask
    construction that shares the Range keeps it, so the mask pass still sees a mask-only subgraph.
    """
    if any(t.name == "position_ids" for t in graph.inputs):
        return
    trig = [n for n in graph.nodes if n.op in ("Cos", "Sin")]
    ancestors, stack = set(), list(trig)
    while stack:
        node = stack.pop()
        if id(node) not in ancestors:
            ancestors.add(id(node))
            stack += [t.inputs[0] for t in node.inputs if t.inputs]
    chain, stack = set(), [n for n in graph.nodes if n.op == "Range" and id(n) in ancestors]
    while stack:
        node = stack.pop()
        if id(node) not in chain and id(node) in ancestors:
            chain.add(id(node))
            stack += [c for t in node.outputs for c in t.outputs]
    if not chain:
        return
    rotary = {id(n) for n in trig}
    for node in reversed(graph.nodes):
        if id(node) in ancestors and node.op != "Range" and all(id(c) in rotary for t in node.outputs for c in t.outputs):
            rotary.add(id(node))
    positions = gs.Variable("position_ids", np.int64, ["batch_size", "sequence_length"])
    flat = None
    for node in graph.nodes:
        if id(node) not in rotary:
            continue
        for j, t in enumerate(node.inputs):
            if not t.inputs or id(t.inputs[0]) not in chain or id(t.inputs[0]) in rotary:
                continue
            rank = len(probe.get(t.name) or [])
            if rank == 2:
                node.inputs[j] = positions
            elif rank == 1:
                if flat is None:
                    flat = gs.Variable(names.new("kv_cache/positions"), np.int64, None)
                    graph.nodes.append(gs.Node("Squeeze", names.new("kv_cache/positions_squeeze"), inputs=[
                        positions, gs.Constant(names.new("kv_cache/axes0"), np.array([0], np.int64))], outputs=[flat]))
                node.inputs[j] = flat
            else:
                raise InputError(f"RoPE positions '{t.name}' have rank {rank}; expected [seq] or [batch, seq]")
            if t.dtype is not None and np.dtype(t.dtype) != np.int64:
                raise InputError(f"RoPE positions '{t.name}' are {np.dtype(t.dtype)}, expected int64")
    for node in list(flat.outputs) if flat is not None else []:  # Unsqueeze(flat, [0, ...]): use positions
        axes = node.attrs.get("axes") if len(node.inputs) < 2 else values_of(node.inputs[1])
        if node.op != "Unsqueeze" or axes is None:
            continue
        rank = 1 + np.size(axes)
        axes = sorted(int(a) % rank for a in np.reshape(axes, -1))
        if axes[0] != 0:
            continue
        if len(axes) == 1:
            out = node.outputs[0]
            for user in list(out.outputs):
                for j, x in enumerate(user.inputs):
                    if x is out:
                        user.inputs[j] = positions
        else:  # cleanup would merge Squeeze + Unsqueeze into a Reshape fixed to T (no RoPE table then)
            node.inputs[0] = positions
            if len(node.inputs) < 2:
                node.attrs["axes"] = axes[1:]
            else:
                node.inputs[1] = gs.Constant(names.new("kv_cache/axes"), np.array(axes[1:], np.int64))
    if positions.outputs:
        graph.inputs.append(positions)

