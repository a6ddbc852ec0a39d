"""bind-shapes: symbolic input dims -> static ints, then shape inference over the whole graph.

Matches every graph input dim that is not a known int (a symbol such as `batch_size`,
`sequence_length`, dynamo's `s53`, hf's numeric strings `'2'`, or unknown). Each dim gets a
value from, in order:

    --input-shape NAME=D0,D1,...              the user's dims for that input
    its role, from the input's name and axis  batch / seq / cache / total (= seq + cache)
    the symbol, when another input bound it   (hf: one `sNN` per tensor, shared by name)
    the symbol's conventional name            batch_size, sequence_length, past_sequence_length

    input_ids, inputs_embeds, hidden_states, position_ids   [batch, seq, ...]
    attention_mask 2-D                                      [batch, total]
    attention_mask 4-D                                      [batch, 1, seq, total]
    past* / *cache* inputs (4-D)                            [batch, heads, cache, head_dim]
    (the DecoderMap's token input, mask source and cache inputs take those roles whatever their names)
    inputs found to be a KV cache by structure              the same, heads and head_dim from the
      (`kv_cache.cache_head_dims`, whatever their names)    entries appended to them / their attention op

total = seq + cache when the graph has cache inputs (by structure or by name), else seq. `batch` defaults to 1 once any
dim is bound.

Extra inputs with no role are handled first: an integer scalar that only picks positions of the
final hidden states (transformers' `logits_to_keep`, which TorchScript traces into a tensor input
when the model itself is exported) is removed with its Gather, with a note:

    hidden [B,S,H] ─► Gather(axis=1, logits_to_keep) ─► lm_head      becomes      hidden ─► lm_head

so the graph returns the logits of every position (what `logits_to_keep=0` means in transformers). Refuses (Miss) a dim it cannot value; a static dim that contradicts the request
is an InputError. Emits: the bound input shapes, output shapes from their dim expressions, and
dtype/shape of every tensor by `mtkc.ir.shapes.infer` (weights stripped, never serialised).
"""

from __future__ import annotations

import ast
import operator

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap, decoder_map
from mtkc.display import escape
from mtkc.errors import InputError
from mtkc.ir import shapes
from mtkc.options import Options
from mtkc.analysis.cache import appended_caches, cache_head_dims
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

SYMBOL_ROLES = {
    "batch": "batch", "batch_size": "batch",
    "sequence_length": "seq", "seq_len": "seq", "sequence": "seq",
    "past_sequence_length": "cache", "past_seq_len": "cache", "cache_length": "cache", "past_length": "cache",
    "total_sequence_length": "total", "past_sequence_length + sequence_length": "total",
    "past_sequence_length+sequence_length": "total", "attention_mask_sequence_length": "total",
}
OPTION_OF_ROLE = {"batch": "--batch", "seq": "--seq-len", "cache": "--cache-len", "total": "--seq-len/--cache-len"}


def input_roles(name: str, rank: int) -> dict[int, str]:
    """Axis -> role for an LLM graph input, from its name and rank."""
    n = name.lower()
    if n.endswith(("input_ids", "inputs_embeds", "hidden_states", "position_ids")) and rank >= 2:
        return {0: "batch", 1: "seq"}
    if "attention_mask" in n or n == "mask":
        return {0: "batch", 1: "total"} if rank == 2 else ({0: "batch", 2: "seq", 3: "total"} if rank == 4 else {})
    if ("past" in n or "cache" in n) and rank == 4:
        return {0: "batch", 2: "cache"}
    if n == "pos_emb" and rank == 4:
        return {2: "seq"}
    return {}


def has_past(roles: dict[str, dict[int, str]]) -> bool:
    """Whether some input has the cache role (`roles_of`)."""
    return any("cache" in r.values() for r in roles.values())


def roles_of(graph: gs.Graph, dm: DecoderMap) -> dict[str, dict[int, str]]:
    """Axis -> role per graph input: the DecoderMap's token input, mask source and cache inputs (found
    by structure, whatever their names), then what the name says (`input_roles`)."""
    cache = {name for layer in dm.layers for name in layer.past.values()}
    roles = {}
    for t in graph.inputs:
        rank = len(t.shape or [])
        if t.name in cache and rank == 4:
            roles[t.name] = {0: "batch", 2: "cache"}
        elif t.name == dm.token_input and rank >= 2:
            roles[t.name] = {0: "batch", 1: "seq"}
        elif t.name == dm.mask_source and rank in (2, 4):
            roles[t.name] = {0: "batch", 1: "total"} if rank == 2 else {0: "batch", 2: "seq", 3: "total"}
        else:
            roles[t.name] = input_roles(t.name, rank)
    return roles


def role_values(options: Options, past: bool) -> dict[str, int | None]:
    seq, cache, batch = options.seq_len, options.cache_len, options.batch
    anything = bool(options.seq_len or options.cache_len or options.batch or options.input_shapes)
    if batch is None and anything:
        batch = 1
    if not past:
        cache = 0
    total = seq + cache if seq is not None and cache is not None else None
    return {"batch": batch, "seq": seq, "cache": cache, "total": total}


@register
class BindShapes(Pass):
    name = "bind-shapes"
    description = "symbolic input dims -> static (--seq-len/--cache-len/--batch/--input-shape), then infer shapes"

    def __init__(self):
        self.removed: list[str] = []  # position-picking inputs removed (map_feeds drops their feeds)

    def applies(self, ctx: Context) -> bool:
        o = ctx.options
        return bool(o.seq_len or o.cache_len or o.batch or o.input_shapes)

    def map_feeds(self, feeds: dict, ctx: Context) -> dict:
        return {k: v for k, v in feeds.items() if k not in self.removed}

    def map_outputs(self, outputs: dict, ctx: Context) -> dict:
        """Without the picking input the logits hold every position, the expected ones only the picked
        row: --verify-each stops comparing them (`mtkc verify` compares each position's row)."""
        return {k: v for k, v in outputs.items() if not (self.removed and k == "logits")}

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        self.removed = keep_all_logits(graph, result)
        current = {ctx.model_name(t.name): t.name for t in graph.inputs}  # kv-cache renamed the cache I/O
        explicit = {current.get(k, k): v for k, v in (ctx.options.input_shapes or {}).items()}
        unknown = sorted(set(explicit) - {t.name for t in graph.inputs})
        if unknown:
            raise InputError(f"--input-shape: the model has no input '{ctx.model_name(unknown[0])}'")
        dm = ctx.analysis(decoder_map, graph)
        heads, named = _head_dims(graph, ctx), roles_of(graph, dm)
        past = bool(heads) or has_past(named)
        if ctx.options.cache_len and not past:
            result.notes.append("--cache-len ignored: the model has no past/cache inputs")
        values = role_values(ctx.options, past)
        symbols: dict[str, int] = {}
        pending = []
        for t in graph.inputs:
            shape = list(t.shape or [])
            if t.name in explicit:
                dims = list(explicit[t.name])
                if len(dims) != len(shape) and shape:
                    raise InputError(f"--input-shape {ctx.model_name(t.name)}: {len(dims)} dims given, the input has rank {len(shape)}")
                for d, v in zip(shape, dims):
                    _check_static(ctx.model_name(t.name), d, v, "--input-shape")
                    if _symbol(d):
                        _learn(symbols, d, v, t.name)
                result.rewrites += sum(1 for d in shape if not _static(d))
                t.shape = dims
                continue
            roles = _roles(t, heads, named)
            for axis, d in enumerate(shape):
                value = _numeric(d)
                role = roles.get(axis) or SYMBOL_ROLES.get(str(d).strip() if d is not None else "")
                if value is None and role is not None:
                    value = values[role]
                if value is None:
                    continue
                if _static(d):
                    _check_static(t.name, d, value, OPTION_OF_ROLE.get(role, "binding"), axis)
                    continue
                if _symbol(d):
                    _learn(symbols, d, value, t.name)
            pending.append(t)
        for t in pending:
            shape, roles = list(t.shape or []), _roles(t, heads, named)
            for axis, d in enumerate(shape):
                if _static(d):
                    continue
                role = roles.get(axis) or SYMBOL_ROLES.get(str(d).strip() if d is not None else "")
                value = _numeric(d)
                if value is None and t.name in heads and axis in (1, 3):
                    value = heads[t.name][axis // 2]
                if value is None and role is not None:
                    value = values[role]
                if value is None and _symbol(d):
                    value = symbols.get(str(d))
                if value is None:
                    hint = OPTION_OF_ROLE.get(role, f"--input-shape {ctx.model_name(t.name)}=...")
                    result.misses.append(Miss(t.name, f"axis {axis} '{d}' is not bound: pass {hint}"))
                    continue
                shape[axis] = value
                result.rewrites += 1
            t.shape = shape
        for t in graph.outputs:
            if t.shape is not None:
                t.shape = [_evaluate(d, symbols) for d in t.shape]
        shapes.infer(graph, ctx.root)
        return result


def keep_all_logits(graph, result: PassResult) -> list[str]:
    """Remove every integer scalar input whose only consumers are Gather(axis=1) index inputs on
    non-constant data (see the module docstring); returns their names."""
    removed = []
    for t in list(graph.inputs):
        consumers = list(t.outputs)
        if (t.dtype is None or not np.issubdtype(np.dtype(t.dtype), np.integer) or t.shape is None or list(t.shape) != []
                or not consumers or not all(_picks_positions(n, t) for n in consumers)):
            continue
        for node in consumers:
            data, out = node.inputs[0], node.outputs[0]
            for user in list(out.outputs):
                for k, x in enumerate(user.inputs):
                    if x is out:
                        user.inputs[k] = data
            for k, o in enumerate(graph.outputs):
                if o is out:
                    graph.outputs[k] = data
            node.inputs.clear()
            node.outputs.clear()
        for o in graph.outputs:  # their declared shapes named the picked position's dims
            o.shape = None
        graph.inputs.remove(t)
        graph.cleanup()
        removed.append(t.name)
        result.rewrites += 1
        result.notes.append(f"input '{escape(t.name)}' (an index picking which positions get logits, as "
                            "transformers' logits_to_keep traces) removed: logits for every position")
    return removed


def _picks_positions(node, index) -> bool:
    attrs = node.attrs or {}
    return (node.op == "Gather" and len(node.inputs) == 2 and node.inputs[1] is index and attrs.get("axis", 0) == 1
            and isinstance(node.inputs[0], gs.Variable) and len(node.inputs[0].shape or [0, 0, 0]) == 3)


def _head_dims(graph, ctx: Context) -> dict[str, tuple[int, int]]:
    """Structural KV-cache inputs -> (kv heads, head dim), looked for only when a rank-4 input has a
    symbolic axis 1 or 3 (cheap otherwise: no shape probe)."""
    if not any(len(t.shape or ()) == 4 and not all(_static(t.shape[a]) for a in (1, 3)) for t in graph.inputs):
        return {}

    return cache_head_dims(graph, appended_caches(graph), ctx.root)  # a refused layer's cache is bound too


def _roles(t, heads: dict, named: dict) -> dict[int, str]:
    if t.name in heads and len(t.shape or ()) == 4:
        return {0: "batch", 2: "cache"}
    return named[t.name]


def _static(d) -> bool:
    return isinstance(d, int) and d >= 0


def _symbol(d) -> bool:
    return isinstance(d, str) and d != "" and _numeric(d) is None


def _numeric(d) -> int | None:
    if isinstance(d, str) and d.strip().isdigit():
        return int(d)
    return None


def _check_static(name: str, d, value: int, option: str, axis: int | None = None) -> None:
    if _static(d) and d != value:
        where = f"axis {axis} " if axis is not None else ""
        raise InputError(f"input '{name}' {where}is {d}, cannot bind it to {value} ({option})")


def _learn(symbols: dict[str, int], d: str, value: int, name: str) -> None:
    if symbols.setdefault(d, value) != value:
        raise InputError(f"input '{name}': dim '{d}' is bound to both {symbols[d]} and {value}")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _evaluate(d, symbols: dict[str, int]):
    """An output dim expression ('s70 + s85', 'past_sequence_length + sequence_length') -> int."""
    if not isinstance(d, str):
        return d
    if _numeric(d) is not None:
        return _numeric(d)
    try:
        return _eval_node(ast.parse(d, mode="eval").body, symbols)
    except (SyntaxError, KeyError, TypeError, ValueError):
        return d


def _eval_node(node, symbols):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return symbols[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left, symbols), _eval_node(node.right, symbols))
    raise ValueError(ast.dump(node))
