"""SwiGLU: the gated MLP's SiLU in the form every SDK table has (Sigmoid then Mul), canonical order.

    y = silu(gate) * up,   silu(g) = g * sigmoid(g)

Matched (anchor: each Sigmoid, and each fused activation node):

    gate ─┬─ Sigmoid ─┐
          └───────────┴─ Mul ─┐
    up ───────────────────────┴─ Mul          (either operand order in both Muls)

    com.microsoft QuickGelu(alpha=1)  (onnxruntime's Sigmoid+Mul fusion)  ─ Mul(·, up)
    Swish(alpha=1) (opset 24)                                            ─ Mul(·, up)

Emitted: Mul(gate, Sigmoid(gate)) then Mul(silu, up). With option `merge_gate_up` (off by default;
it reads both weights) the two projections of the same input, MatMul(x, Wg) and MatMul(x, Wu)
with constant [H, I] weights, become one MatMul(x, Concat(Wg, Wu)) + Split([I, I]).
Refused: a gate and an up that are the same tensor, a SiLU whose alpha is not 1.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import cleanup, replace_uses, toposort
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register
from mtkc.rewrite.pattern import Emit, Op, Or, Var, constant_of, near

MS = "com.microsoft"


def _alpha_one(alpha) -> bool:
    """alpha == 1"""
    return alpha is None or abs(float(alpha) - 1.0) < 1e-6


GATE, UP = Var("gate"), Var("up")
SILU = Or(Op("Mul", GATE, Op("Sigmoid", GATE, name="sigmoid"), name="silu"),
          Op("QuickGelu", GATE, domain=MS, attrs={"alpha": _alpha_one}, name="silu"),
          Op("Swish", GATE, attrs={"alpha": _alpha_one}, name="silu"))
PATTERN = Op("Mul", SILU, UP, name="out")
ANCHORS = {("", "Sigmoid"), (MS, "QuickGelu"), ("", "Swish")}


def find(graph: gs.Graph, ctx: Context | None = None):
    """SwiGLU sites (one per Sigmoid / fused activation) and the anchors that are not one."""
    sites, misses = [], []
    for node in graph.nodes:
        if ((node.domain or ""), node.op) not in ANCHORS:
            continue
        m = near(PATTERN, node, "Mul", steps=2)
        if m and m["gate"] is m["up"]:
            misses.append(Miss(node.name, "gate and up are the same tensor (x * silu(x) is not a gated MLP)"))
        elif m:
            sites.append(m)
        else:
            misses.append(Miss(node.name, f"{m.reason} (at {m.node})"))
    return sites, misses


def _canonical(m) -> bool:
    silu, out = m["silu"], m["out"]
    return silu.op == "Mul" and silu.inputs[0] is m["gate"] and out.inputs[0] is silu.outputs[0]


@register
class SwiGLU(Pass):
    name = "swiglu"
    description = "SwiGLU MLP: SiLU as Sigmoid*Mul in canonical order; optional gate/up MatMul merge"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        sites, result.misses = find(graph, ctx)
        for m in sites:
            if _canonical(m):
                continue
            gate, up, out = m["gate"], m["up"], m["out"].outputs[0]
            e = Emit(graph, m["out"].name)
            sig = e.op("Sigmoid", [gate], dtype=gate.dtype, shape=gate.shape)
            silu = e.op("Mul", [gate, sig], dtype=gate.dtype, shape=gate.shape)
            y = e.op("Mul", [silu, up], dtype=out.dtype, shape=out.shape)
            replace_uses(graph, out, y)
            m["out"].outputs.clear()
            result.rewrites += 1
        if ctx.options.merge_gate_up:
            for m in find(graph, ctx)[0]:
                if _packed(m):
                    continue
                why = _merge(graph, ctx, m)
                if why:
                    result.misses.append(Miss(m["out"].name, f"gate/up merge: {why}"))
                else:
                    result.rewrites += 1
        result.notes.append(f"{len(sites)} SwiGLU sites")
        if result.rewrites:
            toposort(cleanup(graph))
        return result


def _packed(m) -> bool:
    """gate and up already come out of one Split (a merged export)."""
    gate, up = m["gate"].inputs, m["up"].inputs
    return len(gate) == 1 and len(up) == 1 and gate[0] is up[0] and gate[0].op == "Split"


def _merge(graph: gs.Graph, ctx: Context, m) -> str | None:
    """MatMul(x, Wg), MatMul(x, Wu) -> Split(MatMul(x, Concat(Wg, Wu)))."""
    gate_mm = m["gate"].inputs[0] if len(m["gate"].inputs) == 1 else None
    up_mm = m["up"].inputs[0] if len(m["up"].inputs) == 1 else None
    if gate_mm is None or up_mm is None or gate_mm.op != "MatMul" or up_mm.op != "MatMul":
        return "gate and up are not both MatMul outputs"
    if gate_mm.inputs[0] is not up_mm.inputs[0]:
        return "gate and up project different inputs"
    wg, wu = constant_of(gate_mm.inputs[1]), constant_of(up_mm.inputs[1])
    if wg is None or wu is None or len(wg.shape) != 2 or tuple(wg.shape) != tuple(wu.shape):
        return "weights are not constant [H, I] matrices of one shape"
    if len(m["gate"].outputs) != 2 or len(m["up"].outputs) != 1:  # gate feeds Sigmoid and Mul only
        return "gate or up has other consumers"
    read = ctx.read_values or (lambda c: c.values)
    inter = int(wg.shape[1])
    e = Emit(graph, gate_mm.name)
    packed = e.const("gate_up", np.concatenate([read(wg), read(wu)], axis=1))
    both = e.op("MatMul", [gate_mm.inputs[0], packed], dtype=m["gate"].dtype)
    gate, up = e.op("Split", [both, e.ints("sizes", inter, inter)], {"axis": -1},
                    dtype=m["gate"].dtype, outputs=2)
    gate.shape, up.shape = m["gate"].shape, m["up"].shape
    replace_uses(graph, m["gate"], gate)
    replace_uses(graph, m["up"], up)
    return None
