"""RMSNorm: recognise every exported form, emit the SDK's native op or the canonical primitives.

    y = x / sqrt(mean(x², last axis) + eps) * gamma

Matched (rule Decomposed, anchor: each ReduceMean):

    x ─[Cast]─┬─ Pow(·,2) | Mul(·,·) ─ ReduceMean(-1) ─ Add(eps) ─ Sqrt ─ Reciprocal | Div(1,·) ─┐
              └──────────────────────────────────────────────────────────────────── Mul ────────┴─[Cast]─ Mul(gamma)
              (or Div(x, Sqrt(·)) in place of the Reciprocal + Mul; or Pow(·, -0.5))

Matched (rule Fused, anchor: each fused op): RMSNormalization (opset 23), (com.microsoft)
SimplifiedLayerNormalization, com.microsoft SkipSimplifiedLayerNormalization (= Add(input, skip[,
bias]) + norm; its 4th output is the sum).

Emitted: `SimplifiedLayerNormalization` when the table has it (NP >= 8 native RMSNorm; the table
lists it as com.microsoft, onnxruntime runs it in the default domain), else the canonical form
(Reciprocal when the table has it, else Div(1, ·)):

    x ─┬─ Mul(x,x) ─ ReduceMean(-1, keepdims) ─ Add(eps) ─ Sqrt ─ Reciprocal ─┐
       └────────────────────────────────────────────────────────────── Mul ──┴─ Mul(gamma)

Refused: a reduction over other than the last axis, a non-scalar eps, a gamma that is not a
constant vector, a Cast to another float type (mixed precision is kept as exported), or Skip
variants whose mean / inv_std_var outputs are used.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.constants import SMALL, constant_of, values
from mtkc.ir.graph_utils import is_used
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, register
from mtkc.rewrite.pattern import Const, Match, Opt, Or, Refused, Var
from mtkc.rewrite.rules import Rule, RulePass

MS = "com.microsoft"


def _scalar(vals) -> None:
    if vals.size != 1 or not np.issubdtype(vals.dtype, np.floating):
        raise Refused("eps is not a float scalar")


def _vector(tensor: gs.Tensor) -> None:
    """gamma is a constant vector (checked on its shape: the weight is not read)."""
    const = constant_of(tensor)
    if const is None:
        raise Refused(f"gamma '{tensor.name}' is not a constant")
    if not const.shape or any(d != 1 for d in const.shape[:-1]):
        raise Refused(f"gamma has shape {list(const.shape)}, expected a vector")


def _same_float(node: gs.Node) -> bool:
    out, src = node.outputs[0], node.inputs[0]
    return src.dtype is None or out.dtype == src.dtype


def _same_float_cast(node: gs.Node) -> None:
    if not _same_float(node):
        raise Refused("Cast changes the float type (mixed precision)")


def _reduce_last(node: gs.Node) -> None:
    """ReduceMean over the last axis only, keeping it."""
    if node.attrs.get("keepdims", 1) != 1:
        raise Refused("ReduceMean keepdims=0")
    axes = values(node.inputs[1], max_elements=SMALL) if len(node.inputs) > 1 else node.attrs.get("axes")
    if axes is None:
        raise Refused("ReduceMean axes are not a constant")
    axes = [int(a) for a in np.reshape(axes, -1)]
    shape = node.inputs[0].shape
    if len(axes) != 1 or axes[0] not in ([-1] if shape is None else [-1, len(shape) - 1]):
        raise Refused(f"ReduceMean axes {axes}")


def native(ctx: Context) -> bool:
    """The table has the native RMSNorm. It is emitted in the default domain: onnxruntime registers
    SimplifiedLayerNormalization there (com.microsoft has only the Skip variant)."""
    return ctx.table is not None and any(ctx.table.has_op(d, "SimplifiedLayerNormalization") for d in ("", MS))


def _reciprocal(ctx: Context) -> bool:
    return ctx.table is None or ctx.table.has_op("", "Reciprocal")


def emit_norm(op: Emit, ctx: Context, x: gs.Tensor, gamma: gs.Tensor, eps: float) -> gs.Variable:
    """The RMSNorm of `x` in the form this SDK wants (native op or canonical primitives)."""
    dtype, shape = x.dtype, x.shape
    if native(ctx):
        const = constant_of(gamma)
        if const is not None and len(const.shape) != 1:  # [1, 1, H] after rank legalisation: the op takes [H]
            gamma = op.const("gamma", values(const, ctx.read_values).reshape(-1))
        return op.SimplifiedLayerNormalization(x, gamma, axis=-1, epsilon=float(eps), stash_type=1,
                                               _dtype=dtype, _shape=shape)
    reduced = [*shape[:-1], 1] if shape else None  # [..., 1]: keepdims over the last axis
    sq = op.Mul(x, x, _dtype=dtype, _shape=shape)
    if op.graph.opset >= 18:
        mean = op.ReduceMean(sq, op.ints("axes", -1), keepdims=1, _dtype=dtype, _shape=reduced)
    else:
        mean = op.ReduceMean(sq, axes=[-1], keepdims=1, _dtype=dtype, _shape=reduced)
    rms = op.Sqrt(op.Add(mean, op.scalar("eps", eps, x), _dtype=dtype, _shape=reduced), _dtype=dtype, _shape=reduced)
    inv = (op.Reciprocal(rms, _dtype=dtype, _shape=reduced) if _reciprocal(ctx)
           else op.Div(op.scalar("one", 1.0, x), rms, _dtype=dtype, _shape=reduced))
    return op.Mul(op.Mul(x, inv, _dtype=dtype, _shape=shape), gamma, _dtype=dtype, _shape=shape)


class Decomposed(Rule):
    anchor, root, steps, sites = ("ReduceMean",), "Mul", 6, "decomposed RMSNorm"

    def pattern(self, op):
        xf = Var("xf")  # x, or its no-op Cast (looked through in `_input`)
        square = Or(op.Pow(xf, Const(value=2.0)), op.Mul(xf, xf))
        mean = op.ReduceMean(square, _name="mean", _check=_reduce_last, _extra=True)
        rms = op.Sqrt(op.Add(mean, Const("eps", check=_scalar)))
        inv = Or(op.Reciprocal(rms), op.Div(Const(value=1.0), rms),
                 op.Pow(op.Add(mean, Const("eps", check=_scalar)), Const(value=-0.5)))
        normed = Or(op.Mul(xf, inv), op.Div(xf, rms))
        return op.Mul(Opt("Cast", normed, check=_same_float_cast), Var("gamma", check=_vector), _name="out")

    def done(self, ctx, m):
        """Already exactly what `emit_norm` produces."""
        ops = [n.op for n in m.nodes]
        inv = "Reciprocal" if _reciprocal(ctx) else "Div"
        return not native(ctx) and _input(m) is m["xf"] and "Pow" not in ops and "Cast" not in ops \
            and inv in ops and (inv == "Reciprocal" or ops.count("Div") == 1)

    def rewrite(self, op, ctx, m):
        eps = float(m.value("eps").reshape(-1)[0])
        return [(m["out"].outputs[0], emit_norm(op, ctx, _input(m), m["gamma"], eps))]


def _input(m: Match) -> gs.Tensor:
    """x is xf, or the input of the no-op Cast producing xf."""
    xf = m["xf"]
    node = xf.inputs[0] if len(xf.inputs) == 1 else None
    return node.inputs[0] if node is not None and node.op == "Cast" and _same_float(node) else xf


class Fused(Rule):
    anchor = ("RMSNormalization", "SimplifiedLayerNormalization", f"{MS}::SimplifiedLayerNormalization",
              f"{MS}::SkipSimplifiedLayerNormalization")
    sites = "fused RMSNorm"

    def done(self, ctx, m):
        node = m["node"]
        if node.op == "SkipSimplifiedLayerNormalization":
            return ctx.table is not None and ctx.table.has_op(MS, node.op)
        return node.op == "SimplifiedLayerNormalization" and native(ctx)

    def check(self, ctx, m):
        node = m["node"]
        axis, shape = node.attrs.get("axis", -1), node.inputs[0].shape
        if axis != -1 and (shape is None or axis != len(shape) - 1):
            raise Refused(f"{node.op} over axis {axis}, only the last axis is supported")
        if node.op == "SkipSimplifiedLayerNormalization" and any(is_used(m.graph, o) for o in node.outputs[1:3]):
            raise Refused("SkipSimplifiedLayerNormalization mean/inv_std_var outputs are used")

    def rewrite(self, op, ctx, m):
        node = m["node"]
        skip = node.op == "SkipSimplifiedLayerNormalization"
        x = node.inputs[0]
        if skip:
            x = op.Add(node.inputs[0], node.inputs[1], _dtype=x.dtype, _shape=x.shape)
            if len(node.inputs) > 3 and node.inputs[3].name:
                x = op.Add(x, node.inputs[3], _dtype=x.dtype, _shape=x.shape)
        gamma, eps = node.inputs[2 if skip else 1], float(node.attrs.get("epsilon", 1e-5))
        replaced = [(node.outputs[0], emit_norm(op, ctx, x, gamma, eps))]
        if skip and len(node.outputs) > 3:
            replaced.append((node.outputs[3], x))
        return replaced


@register
class RMSNorm(RulePass):
    name = "rmsnorm"
    description = "RMSNorm (any exported form) to the SDK's native op or Mul/ReduceMean/Sqrt/Reciprocal"
    rules = (Decomposed(), Fused())
