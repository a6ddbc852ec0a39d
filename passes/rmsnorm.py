"""RMSNorm: recognise every exported form, emit the SDK's native op or the canonical primitives.

    y = x / sqrt(mean(x², last axis) + eps) * gamma

Matched (anchor: each ReduceMean; the fused ops are sites on their own):

    x ─[Cast]─┬─ Pow(·,2) | Mul(·,·) ─ ReduceMean(-1) ─ Add(eps) ─ Sqrt ─ Reciprocal | Div(1,·) ─┐
              └──────────────────────────────────────────────────────────────────── Mul ────────┴─[Cast]─ Mul(gamma)
              (or Div(x, Sqrt(·)) in place of the Reciprocal + Mul; or Pow(·, -0.5))

    RMSNormalization (opset 23), com.microsoft SimplifiedLayerNormalization,
    com.microsoft SkipSimplifiedLayerNormalization (= Add(input, skip[, bias]) + norm; its 4th output is the sum)

Emitted: `SimplifiedLayerNormalization` when the table has it (NP >= 8 native RMSNorm; the table
lists it as com.microsoft, onnxruntime runs it in the default domain), else the canonical form below (Reciprocal when the table has it, else Div(1, ·)):

    x ─┬─ Mul(x,x) ─ ReduceMean(-1, keepdims) ─ Add(eps) ─ Sqrt ─ Reciprocal ─┐
       └────────────────────────────────────────────────────────────── Mul ──┴─ Mul(gamma)

Refused: a reduction over other than the last axis, a non-scalar eps, a gamma that is not a
constant vector, a Cast to another float type (mixed precision is kept as exported), or Skip
variants whose mean / inv_std_var outputs are used.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import cleanup, replace_uses, toposort
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register
from mtkc.rewrite.pattern import Const, Emit, Match, Op, Opt, Or, Var, constant_of, near, small_values, values_of

MS = "com.microsoft"
FUSED = {("", "RMSNormalization"), ("", "SimplifiedLayerNormalization"), (MS, "SimplifiedLayerNormalization"),
         (MS, "SkipSimplifiedLayerNormalization")}


def _scalar(values) -> str | None:
    return None if values.size == 1 and np.issubdtype(values.dtype, np.floating) else "eps is not a float scalar"


def _vector(tensor: gs.Tensor) -> str | None:
    """gamma is a constant vector (checked on its shape: the weight is not read)."""
    const = constant_of(tensor)
    if const is None:
        return f"gamma '{tensor.name}' is not a constant"
    shape = list(const.shape)
    return None if shape and all(d == 1 for d in shape[:-1]) else f"gamma has shape {shape}, expected a vector"


def _same_float_cast(node: gs.Node) -> str | None:
    out, src = node.outputs[0], node.inputs[0]
    return None if src.dtype is None or out.dtype == src.dtype else "Cast changes the float type (mixed precision)"


def _reduce_last(node: gs.Node) -> str | None:
    """ReduceMean over the last axis only, keeping it."""
    if node.attrs.get("keepdims", 1) != 1:
        return "ReduceMean keepdims=0"
    axes = small_values(node.inputs[1]) if len(node.inputs) > 1 else node.attrs.get("axes")
    if axes is None:
        return "ReduceMean axes are not a constant"
    axes = [int(a) for a in np.reshape(axes, -1)]
    shape = node.inputs[0].shape
    last = [-1] if shape is None else [-1, len(shape) - 1]
    return None if len(axes) == 1 and axes[0] in last else f"ReduceMean axes {axes}"


def _pattern() -> Op:
    xf = Var("xf")  # x, or its no-op Cast (looked through after the match)
    square = Or(Op("Pow", xf, Const(value=2.0)), Op("Mul", xf, xf))
    mean = Op("ReduceMean", square, name="mean", check=_reduce_last, extra_inputs=True)
    rms = Op("Sqrt", Op("Add", mean, Const("eps", check=_scalar)))
    inv = Or(Op("Reciprocal", rms), Op("Div", Const(value=1.0), rms),
             Op("Pow", Op("Add", mean, Const("eps", check=_scalar)), Const(value=-0.5)))
    normed = Or(Op("Mul", xf, inv), Op("Div", xf, rms))
    return Op("Mul", Opt("Cast", normed, check=_same_float_cast), Var("gamma", check=_vector), name="out")


PATTERN = _pattern()


def find(graph: gs.Graph, ctx: Context | None = None) -> tuple[list[Match], list[Miss]]:
    """Decomposed RMSNorm sites (one per ReduceMean) and the ReduceMeans that are not one."""
    read = ctx.read_values if ctx else None
    sites, misses, covered = [], [], set()
    for node in list(graph.nodes):
        if node.op != "ReduceMean" or id(node) in covered:
            continue
        m = near(PATTERN, node, "Mul", steps=6, read=read)
        if m:
            sites.append(_bind_input(m))
            covered.update(id(n) for n in m.nodes)
        else:
            misses.append(Miss(node.name, f"{m.reason} (at {m.node})"))
    return sites, misses


def _bind_input(m: Match) -> Match:
    """x is xf, or the input of the no-op Cast producing xf."""
    xf = m["xf"]
    node = xf.inputs[0] if len(xf.inputs) == 1 else None
    if node is not None and node.op == "Cast" and _same_float_cast(node) is None:
        m.bindings["x"] = node.inputs[0]
    else:
        m.bindings["x"] = xf
    return m


def native(ctx: Context) -> bool:
    """The table has the native RMSNorm. It is emitted in the default domain: onnxruntime registers
    SimplifiedLayerNormalization there (com.microsoft has only the Skip variant)."""
    return ctx.table is not None and any(ctx.table.has_op(d, "SimplifiedLayerNormalization") for d in ("", MS))


def emit_norm(graph: gs.Graph, ctx: Context, x: gs.Tensor, gamma: gs.Tensor, eps: float, prefix: str) -> gs.Variable:
    """The RMSNorm of `x` in the form this SDK wants (native op or canonical primitives)."""
    e = Emit(graph, prefix)
    dtype, shape = x.dtype, x.shape
    if native(ctx):
        const = constant_of(gamma)
        if const is not None and len(const.shape) != 1:  # [1, 1, H] after rank legalisation: the op takes [H]
            gamma = e.const("gamma", np.asarray(values_of(const, ctx.read_values)).reshape(-1))
        return e.op("SimplifiedLayerNormalization", [x, gamma], {"axis": -1, "epsilon": float(eps), "stash_type": 1},
                    dtype=dtype, shape=shape)
    fdt = np.dtype(dtype) if dtype is not None else np.dtype(np.float32)
    sq = e.op("Mul", [x, x], dtype=dtype, shape=shape)
    axes = e.ints("axes", -1)
    mean = e.op("ReduceMean", [sq, axes], {"keepdims": 1}, dtype=dtype) if _opset18(graph) else \
        e.op("ReduceMean", [sq], {"axes": [-1], "keepdims": 1}, dtype=dtype)
    var = e.op("Add", [mean, e.const("eps", np.array(eps, fdt))], dtype=dtype)
    rms = e.op("Sqrt", [var], dtype=dtype)
    if ctx.table is None or ctx.table.has_op("", "Reciprocal"):
        inv = e.op("Reciprocal", [rms], dtype=dtype)
    else:
        inv = e.op("Div", [e.const("one", np.array(1.0, fdt)), rms], dtype=dtype)
    normed = e.op("Mul", [x, inv], dtype=dtype, shape=shape)
    return e.op("Mul", [normed, gamma], dtype=dtype, shape=shape)


def _opset18(graph: gs.Graph) -> bool:
    return graph.opset >= 18


def _canonical(m: Match, ctx: Context) -> bool:
    """Already exactly what `emit_norm` would produce (keeps the pass idempotent)."""
    if native(ctx):
        return False
    ops = [n.op for n in m.nodes]
    want_inv = "Reciprocal" if ctx.table is None or ctx.table.has_op("", "Reciprocal") else "Div"
    return m["x"] is m["xf"] and "Pow" not in ops and "Cast" not in ops and want_inv in ops \
        and (want_inv == "Reciprocal" or ops.count("Div") == 1)


@register
class RMSNorm(Pass):
    name = "rmsnorm"
    description = "RMSNorm (any exported form) to the SDK's native op or Mul/ReduceMean/Sqrt/Reciprocal"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        sites, result.misses = find(graph, ctx)
        for m in sites:
            if _canonical(m, ctx):
                continue
            out = m["out"].outputs[0]
            eps = float(m.value("eps").reshape(-1)[0])
            new = emit_norm(graph, ctx, m["x"], m["gamma"], eps, m["out"].name)
            new.dtype, new.shape = out.dtype or new.dtype, out.shape
            replace_uses(graph, out, new)
            result.rewrites += 1
        for node in [n for n in graph.nodes if ((n.domain or ""), n.op) in FUSED]:
            why = self._fused(graph, ctx, node)
            if why is None:
                result.rewrites += 1
            elif why:
                result.misses.append(Miss(node.name, why))
        result.notes.append(f"{len(sites)} decomposed RMSNorm sites")
        if result.rewrites:
            toposort(cleanup(graph))
        return result

    def _fused(self, graph: gs.Graph, ctx: Context, node: gs.Node) -> str | None:
        """Rewrite one fused norm; returns a reason when refused, '' when left as is."""
        skip = node.op == "SkipSimplifiedLayerNormalization"
        if node.op == "SimplifiedLayerNormalization" and native(ctx):
            return ""
        if skip and ctx.table is not None and ctx.table.has_op(MS, node.op):
            return ""
        axis = node.attrs.get("axis", -1)
        rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
        if axis != -1 and (rank is None or axis != rank - 1):
            return f"{node.op} over axis {axis}, only the last axis is supported"
        if skip and any(len(o.outputs) or o in graph.outputs for o in node.outputs[1:3]):
            return "SkipSimplifiedLayerNormalization mean/inv_std_var outputs are used"
        gamma, eps = node.inputs[2 if skip else 1], float(node.attrs.get("epsilon", 1e-5))
        x = node.inputs[0]
        e = Emit(graph, node.name)
        if skip:
            x = e.op("Add", [node.inputs[0], node.inputs[1]], dtype=x.dtype, shape=x.shape)
            if len(node.inputs) > 3 and node.inputs[3].name:
                x = e.op("Add", [x, node.inputs[3]], dtype=x.dtype, shape=x.shape)
        new = emit_norm(graph, ctx, x, gamma, eps, node.name)
        out = node.outputs[0]
        new.dtype, new.shape = out.dtype or new.dtype, out.shape
        replace_uses(graph, out, new)
        if skip and len(node.outputs) > 3:
            replace_uses(graph, node.outputs[3], x)
        node.outputs.clear()
        return None
