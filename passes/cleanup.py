"""cleanup: remove what computes nothing, merge what computes the same thing (to a fixed point).

    no-ops        Identity(x), Cast(x:T, to=T), Reshape/Expand/Squeeze/Unsqueeze/Flatten to the
                  same static shape, Transpose(perm=identity), single-input Concat,
                  Slice covering the whole tensor                                  -> x
    inverse pairs Transpose(Transpose(x, p), q)      -> Transpose(x, p∘q) or x
                  Cast(Cast(x:S, to=M), to=T), M holds every S value exactly      -> Cast(x, to=T) or x
                  reshape-like(reshape-like(x)) (Reshape/Squeeze/Unsqueeze/Flatten, static
                  output)                            -> Reshape(x, static shape) (or x)
    duplicates    constants with equal dtype/shape/bytes (in-memory, <= 1 MiB: by hash;
                  external: by (file, offset, length)) -> the first one
                  nodes with equal op, domain, attributes and inputs (CSE)     -> the first one
    dead nodes    not contributing to a graph output                           -> removed

Refuses nothing by design; a rewrite that would rename a graph input is skipped. Each sweep is
linear in the graph size (dict lookups, no pairwise scans); sweeps repeat until none rewrites.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.ir.constants import elements, ints, is_lazy, values
from mtkc.ir.toposort import toposort
from mtkc.rewrite.pass_api import Context, Pass, PassResult, register

MAX_SWEEPS = 10
HASH_ELEMENTS = 1 << 18
RESHAPE_LIKE = {"Reshape", "Squeeze", "Unsqueeze", "Flatten"}
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}

# dtype -> dtypes that hold every value of it exactly (for Cast chains)
_EXACT = {
    "bool": {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"},
    "int8": {"int16", "int32", "int64", "float16", "float32", "float64"},
    "uint8": {"int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"},
    "int16": {"int32", "int64", "float32", "float64"},
    "uint16": {"int32", "uint32", "int64", "uint64", "float32", "float64"},
    "int32": {"int64", "float64"},
    "uint32": {"int64", "uint64", "float64"},
    "float16": {"float32", "float64"},
    "float32": {"float64"},
}


@register
class Cleanup(Pass):
    name = "cleanup"
    description = "dead nodes, no-op ops, inverse pairs, duplicate constants and subexpressions"

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        for _ in range(MAX_SWEEPS):
            n = remove_noops(graph, ctx) + merge_pairs(graph, ctx) + dedupe_constants(graph, ctx) + cse(graph)
            detached = sum(1 for node in graph.nodes if not node.outputs)
            before = len(graph.nodes)
            toposort(gu.cleanup(graph))
            n += before - len(graph.nodes) - detached  # dead nodes
            if n == 0:
                break
            result.rewrites += n
        return result


def _dtype(t: gs.Tensor) -> str | None:
    d = gu.dtype_of(t)
    return d.name if d is not None else None


def _onnx(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


def _graph_inputs(graph: gs.Graph) -> set[int]:
    return {id(t) for t in graph.inputs}


def is_noop(node: gs.Node, ctx: Context) -> bool:
    """True when the node's only output equals its first input."""
    if not _onnx(node) or len(node.outputs) != 1 or not node.inputs:
        return False
    x, y = node.inputs[0], node.outputs[0]
    op = node.op
    if op == "Identity":
        return True
    if op == "Cast":
        return _dtype(x) is not None and _dtype(x) == onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"]).name
    if op == "Concat":
        return len(node.inputs) == 1
    if op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    if op in RESHAPE_LIKE or op == "Expand":
        sx, sy = gu.static_shape(x), gu.static_shape(y)
        return sx is not None and sx == sy and _dtype(x) == _dtype(y)
    if op == "Slice":
        return _full_slice(node, ctx)
    return False


def _full_slice(node: gs.Node, ctx: Context) -> bool:
    shape = gu.static_shape(node.inputs[0])
    if shape is None or gu.static_shape(node.outputs[0]) != shape:
        return False
    steps = ints(node.inputs[4], ctx.read_values) if len(node.inputs) > 4 and not node.inputs[4].is_empty() else None
    return steps is None or all(s == 1 for s in steps)


def remove_noops(graph: gs.Graph, ctx: Context) -> int:
    n = 0
    inputs = _graph_inputs(graph)
    outputs = {id(t) for t in graph.outputs}  # renamable() is True for the rest (and cheaper unasked)
    for node in list(graph.nodes):
        if not node.outputs or id(node.outputs[0]) in inputs:
            continue
        is_output = id(node.outputs[0]) in outputs
        if is_noop(node, ctx) and (not is_output or gu.renamable(graph, node.outputs[0], node.inputs[0])):
            gu.bypass(graph, node, outputs=outputs)  # which gives an output to another tensor in `outputs` too
            n += 1
    return n


def merge_pairs(graph: gs.Graph, ctx: Context) -> int:
    """Transpose∘Transpose, lossless Cast∘Cast, reshape-like chains: one node (or none)."""
    n = 0
    names = gu.Names(graph)
    for node in list(graph.nodes):
        if not node.outputs or not node.inputs or not _onnx(node):
            continue
        x = node.inputs[0]
        producer = x.inputs[0] if len(x.inputs) == 1 else None
        if producer is None or not _onnx(producer) or not producer.inputs:
            continue
        src = producer.inputs[0]
        if node.op == "Transpose" and producer.op == "Transpose":
            p, q = producer.attrs.get("perm"), node.attrs.get("perm")
            if p is None or q is None:
                continue
            node.attrs["perm"] = [int(p[i]) for i in q]
            node.inputs[0] = src
            n += 1
        elif node.op == "Cast" and producer.op == "Cast":
            s, mid = _dtype(src), _dtype(x)
            if s is not None and mid is not None and (mid in _EXACT.get(s, set())):
                node.inputs[0] = src
                n += 1
        elif node.op in RESHAPE_LIKE and producer.op in RESHAPE_LIKE:
            shape = gu.static_shape(node.outputs[0])
            if shape is None or 0 in shape or _dtype(src) is None:
                continue
            const = gu.make_constant(names.new(f"{node.name}/shape"), shape, np.int64)
            node.op, node.attrs = "Reshape", {}
            gu.clear_inputs(node)
            node.inputs.extend([src, const])
            n += 1
    return n


def dedupe_constants(graph: gs.Graph, ctx: Context) -> int:
    """Constants with equal dtype, shape and bytes become one (never reads external data)."""
    first: dict[tuple, gs.Constant] = {}
    n = 0
    consts = {id(t): t for node in graph.nodes for t in node.inputs if isinstance(t, gs.Constant)}
    outputs = {id(t) for t in graph.outputs}
    for t in sorted(consts.values(), key=lambda c: c.name):
        if id(t) in outputs:
            continue
        key = _constant_key(t)
        if key is None:
            continue
        keep = first.setdefault(key, t)
        if keep is not t:
            gu.rewire(t, keep)  # t is no graph output
            n += 1
    return n


def _constant_key(t: gs.Constant) -> tuple | None:
    if is_lazy(t):
        proto = t._values.tensor
        if proto.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in proto.external_data}
            return ("ext", proto.data_type, tuple(proto.dims), info.get("location"), info.get("offset", "0"), info.get("length"))
    if elements(t) > HASH_ELEMENTS:
        return None
    v = values(t)  # not ascontiguousarray: it turns a 0-d array into a 1-d one
    return ("mem", v.dtype.str, v.shape, hashlib.sha1(v.tobytes()).hexdigest())


def cse(graph: gs.Graph) -> int:
    """Nodes with the same op, domain, attributes and input tensors: keep the first."""
    toposort(graph)
    seen: dict[tuple, gs.Node] = {}
    n = 0
    outputs = {id(t) for t in graph.outputs}
    for node in list(graph.nodes):
        if node.op in NONDETERMINISTIC or not node.outputs or any(id(t) in outputs for t in node.outputs):
            continue
        key = _node_key(node)
        if key is None:
            continue
        other = seen.setdefault(key, node)
        if other is node or len(other.outputs) != len(node.outputs):
            continue
        for mine, theirs in zip(node.outputs, other.outputs):
            gu.rewire(mine, theirs)  # no output of `node` is a graph output
        gu.detach([node])
        n += 1
    return n


def _node_key(node: gs.Node) -> tuple | None:
    attrs = []
    for k in sorted(node.attrs):
        v = node.attrs[k]
        if isinstance(v, gs.Graph):
            return None
        if isinstance(v, gs.Tensor):
            v = ("tensor", id(v))
        elif isinstance(v, (list, tuple)):
            v = tuple(v)
        elif isinstance(v, np.ndarray):
            v = (v.dtype.str, v.shape, v.tobytes())
        attrs.append((k, v))
    try:
        key = (node.op, node.domain or "", tuple(attrs), tuple(id(t) for t in node.inputs), len(node.outputs))
        hash(key)
    except TypeError:
        return None
    return key
