"""fold: constant and shape folding, evaluated by onnxruntime in one batch per round.

    Constant(value=...)                       -> the constant tensor itself
    Shape(x) / Size(x), x static-shaped       -> int64 constant (start/end honoured)
    If(constant condition)                    -> the taken branch's nodes
    op(c0, c1, ...), every input constant     -> constant outputs, computed by onnxruntime
      (Gather/Unsqueeze/Concat/Slice/Range/ConstantOfShape/Expand/Cast/Reshape/Equal/Where/
       Add/Mul/... -- any deterministic ONNX-domain op without subgraphs)

The small integer shape operands among them (`mtkc.ir.shape_values`: exact, in numpy) are folded
first, without onnxruntime: at 0.5B 1777 of a round's 1790 nodes, whose one session cost more
than the rest of the pass; the few others (the mask's Range/LessOrEqual/And) then run in it.

Rounds repeat (fold -> re-infer shapes where a tensor is untyped -> fold) until nothing changes,
so TorchScript's shape maths (Shape -> Gather -> Unsqueeze -> Concat -> Reshape) disappears once
shapes are bound.

Size policy: an output is folded when it has at most FOLD_MAX_ELEMENTS (1 Mi) elements, or
when it is a pure relayout of one constant (Transpose/Reshape/Squeeze/Unsqueeze/Flatten/
Identity, same element count) -- except a big Transpose of a weight still lazy on disk: the
tied lm_head's `Transpose(W[V,H])` (545 MB at 0.5B, 933 MB at 1.5B) stays a runtime Transpose,
so W is never read into memory and is stored once (converters fold constant transposes
themselves). Only the constants a folded node consumes are read (by onnxruntime, from
external data in place).
Refuses (Miss): outputs over the cap, outputs of unknown shape that could grow (Expand, Tile,
ConstantOfShape, Range, ...), graph outputs, random ops, ops outside the ONNX domain.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import execute, shape_values, shapes
from mtkc.ir import graph_utils as gu
from mtkc.ir.constants import is_lazy
from mtkc.ir.toposort import toposort
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

FOLD_MAX_ELEMENTS = 1 << 20
MAX_ROUNDS = 8
RELAYOUT_OPS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
GROWING_OPS = {"Expand", "Tile", "ConstantOfShape", "Range", "Resize", "Pad", "OneHot", "Upsample", "EyeLike"}
NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
              "Bernoulli", "If", "Loop", "Scan", "Constant", "Dropout",
              "DequantizeLinear", "QuantizeLinear"}  # quantised weights reach the converter quantised


@register
class Fold(Pass):
    name = "fold"
    description = "constant and shape folding (Constant nodes, Shape of static tensors, all-constant subgraphs)"

    def run(self, graph, ctx: Context) -> PassResult:
        result = PassResult()
        for _ in range(MAX_ROUNDS):
            misses: list[Miss] = []
            n = (fold_constant_nodes(graph, misses) + fold_shapes(graph, misses) + fold_branches(graph)
                 + fold_subgraphs(graph, ctx, misses))
            if n == 0:
                result.misses = misses
                break
            result.rewrites += n
            gu.cleanup(graph)
            if not shapes.settled(graph):  # folding keeps shapes; an inlined If branch brings new tensors
                shapes.infer(graph, ctx.root)
        return result


def fold_constant_nodes(graph: gs.Graph, misses: list[Miss]) -> int:
    """Constant nodes become constant tensors (lazy external values stay lazy)."""
    outputs = {t.name for t in graph.outputs}
    n = 0
    for node in graph.nodes:
        if node.op != "Constant" or not _onnx(node) or not node.outputs:
            continue
        out = node.outputs[0]
        if out.name in outputs:
            misses.append(Miss(node.name, "Constant output is a graph output"))
            continue
        value = _constant_attr(node)
        if value is None:
            misses.append(Miss(node.name, f"Constant attribute {sorted(node.attrs)} not foldable"))
            continue
        node.outputs.clear()
        out.to_constant(value)
        n += 1
    return n


def fold_branches(graph: gs.Graph) -> int:
    """If with a constant condition -> the taken branch's nodes in its place (onnxruntime-genai's
    long/short RoPE cache switch on the total length, constant once the lengths are bound)."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "If" or not _onnx(node) or not isinstance(node.inputs[0], gs.Constant):
            continue
        branch = node.attrs["then_branch" if bool(np.asarray(node.inputs[0].values).ravel()[0]) else "else_branch"]
        graph.nodes.extend(branch.nodes)  # outer-scope tensors are the outer graph's own objects
        outs = list(node.outputs)
        node.outputs.clear()
        for old, new in zip(outs, branch.outputs):
            gu.replace_uses(graph, old, new)
        n += 1
    if n:
        toposort(graph)
    return n


def _constant_attr(node: gs.Node):
    attrs = node.attrs
    if isinstance(attrs.get("value"), gs.Constant):
        return attrs["value"]._values
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    return None


def fold_shapes(graph: gs.Graph, misses: list[Miss]) -> int:
    """Shape/Size of a static-shaped tensor -> int64 constant."""
    outputs = {t.name for t in graph.outputs}
    n = 0
    for node in graph.nodes:
        if node.op not in ("Shape", "Size") or not _onnx(node) or not node.outputs:
            continue
        out = node.outputs[0]
        shape = gu.static_shape(node.inputs[0])
        if shape is None or out.name in outputs:
            if out.name not in outputs and not all(isinstance(d, int) for d in (node.inputs[0].shape or ["?"])):
                misses.append(Miss(node.name, f"input '{node.inputs[0].name}' has no static shape"))
            continue
        if node.op == "Size":
            value = np.asarray(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
        else:
            rank = len(shape)
            start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
            value = np.asarray(shape[slice(start, end)], dtype=np.int64)
        gu.detach([node])
        out.to_constant(value)
        n += 1
    return n


def fold_subgraphs(graph: gs.Graph, ctx: Context, misses: list[Miss]) -> int:
    """Every node whose inputs are all constant (or folded) and whose outputs fit the policy."""
    toposort(graph)
    outputs = {t.name for t in graph.outputs}
    known: set[str] = set()
    foldable: list[gs.Node] = []
    for node in graph.nodes:
        ins = [t for t in node.inputs if not t.is_empty()]
        if not ins or not _onnx(node) or node.op in NEVER_FOLD:
            continue
        if not all(isinstance(t, gs.Constant) or t.name in known for t in ins):
            continue
        reason = _refusal(node, outputs)
        if reason:
            misses.append(Miss(node.name, reason))
            continue
        foldable.append(node)
        known.update(t.name for t in node.outputs if not t.is_empty())
    if not foldable:
        return 0
    operands = shape_values.known_values(graph)
    exact, rest = [], []
    for node in foldable:
        (exact if all(t.is_empty() or t.name in operands for t in node.outputs) else rest).append(node)
    _replace(exact, operands)  # in numpy; the rest then reads their values as constants
    if not rest:
        return len(exact)
    values = _run_batch(graph, rest, _frontier(rest), ctx)
    if values is None:  # onnxruntime rejected the batch: evaluate node by node, skip failures
        values = _run_each(graph, rest, ctx, misses)
        rest = [n for n in rest if all(t.is_empty() or t.name in values for t in n.outputs)]
    _replace(rest, values)
    return len(exact) + len(rest)


def _replace(nodes: list[gs.Node], values: dict[str, np.ndarray]) -> None:
    """Detach folded `nodes`; each output read elsewhere becomes a constant of its value."""
    frontier = _frontier(nodes)
    gu.detach(nodes)
    for t in frontier:
        t.to_constant(values[t.name])


def _frontier(nodes: list[gs.Node]) -> list[gs.Tensor]:
    """Outputs of `nodes` read by some node outside `nodes`."""
    ids = {id(n) for n in nodes}
    return [t for n in nodes for t in n.outputs if not t.is_empty() and any(id(c) not in ids for c in t.outputs)]


def _refusal(node: gs.Node, outputs: set[str]) -> str | None:
    if any(t.name in outputs for t in node.outputs):
        return "output is a graph output"
    if any(isinstance(a, gs.Graph) for a in node.attrs.values()):
        return "has a subgraph"
    for out in node.outputs:
        if out.is_empty():
            continue
        shape = gu.static_shape(out)
        if shape is None:
            if node.op in GROWING_OPS:
                return f"output '{out.name}' has no static shape and {node.op} can grow it"
            continue
        size = int(np.prod(shape, dtype=np.int64))
        if size <= FOLD_MAX_ELEMENTS:
            continue
        src = node.inputs[0]
        if node.op == "Transpose" and isinstance(src, gs.Constant) and is_lazy(src):
            return f"Transpose of weight '{src.name}' ({size} elements) kept: folding would read it and store it twice"
        if node.op in RELAYOUT_OPS and isinstance(src, gs.Constant) and int(np.prod(src.shape, dtype=np.int64)) == size:
            continue
        return f"output '{out.name}' has {size} elements (> {FOLD_MAX_ELEMENTS}) and is not a relayout of one constant"
    return None


def _run_batch(graph: gs.Graph, nodes: list[gs.Node], frontier: list[gs.Tensor], ctx: Context):
    """Run `nodes` in one onnxruntime session; their frontier values, or None if ORT refuses."""
    try:
        return _run(graph, nodes, frontier, ctx)
    except Exception:
        return None


def _run_each(graph: gs.Graph, nodes: list[gs.Node], ctx: Context, misses: list[Miss]) -> dict[str, np.ndarray]:
    """Evaluate node by node on copies (slow path); a node ORT refuses is a Miss."""
    values: dict[str, np.ndarray] = {}
    for node in nodes:
        ins = []
        for t in node.inputs:
            if t.is_empty() or isinstance(t, gs.Constant):
                ins.append(gs.Variable.empty() if t.is_empty() else gs.Constant(t.name, t._values))
            elif t.name in values:
                ins.append(gs.Constant(t.name, values[t.name]))
            else:
                break
        else:
            outs = [gs.Variable(t.name, dtype=t.dtype) if not t.is_empty() else gs.Variable.empty() for t in node.outputs]
            copy = gs.Node(node.op, name=node.name, attrs=dict(node.attrs), inputs=ins, outputs=outs, domain=node.domain)
            try:
                values.update(_run(graph, [copy], [t for t in outs if not t.is_empty()], ctx))
            except Exception as exc:
                misses.append(Miss(node.name, f"onnxruntime cannot evaluate it: {str(exc).splitlines()[0][:160]}"))
    return values


def _run(graph: gs.Graph, nodes: list[gs.Node], outputs: list[gs.Tensor], ctx: Context) -> dict[str, np.ndarray]:
    sub = gs.Graph(nodes=nodes, inputs=[], outputs=outputs, opset=graph.opset,
                   import_domains=graph.import_domains, ir_version=graph.ir_version)
    proto = gs.export_onnx(sub, do_type_check=False)
    for out in proto.graph.output:  # onnxruntime infers them; stale declared shapes would conflict
        out.type.tensor_type.ClearField("shape")
    return execute.run(proto, {}, ctx.root)


def _onnx(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")
