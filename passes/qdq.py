"""dynamic-quant: onnxruntime `quantize_dynamic` output as weight-only QDQ the NPU keeps.

`quantize_dynamic` quantises each MatMul's activation at run time (a scale per call), which MDLA
cannot do (static scales from calibration only):

    x ─ DynamicQuantizeLinear ─ xq, xs, xzp              x ──────────────────────────┐
    MatMulInteger(xq, Wq, xzp, wzp) ─ Cast(float) ─┐  =>                             MatMul ─ y
    Mul(xs, ws) ───────────────────────────────────Mul ─ y   Wq ─ DequantizeLinear(ws, wzp) ┘

The int8 weights stay int8 behind a DequantizeLinear (per tensor, or per output column when `ws`
holds one scale per column), the activation becomes float again: the converter quantises it from
calibration data (`mtkc calibrate`, `mtkc convert --quant`). Numbers change by the dynamic
activation rounding only. Refused (Miss, the nodes then run on the CPU): a MatMulInteger not fed
by DynamicQuantizeLinear, a non-constant weight or scale, or an output not scaled by xs * ws.

`quantization_state(graph)` says what a model already holds (Q/DQ, per-channel weights, dynamic
or QOperator ops) for `mtkc check`.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import graph_utils as gu
from mtkc.ir.constants import values
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

QOPERATOR = {"QLinearMatMul", "QLinearConv", "QLinearAdd", "QLinearMul", "QGemm", "QAttention", "MatMulNBits"}
DYNAMIC = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}


def _only_consumer(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 and t.outputs[0].op == op else None


def _match(node: gs.Node, outputs: set[str]) -> tuple[gs.Node, gs.Node, gs.Constant, str] | str:
    """(DynamicQuantizeLinear, final Mul, weight scale, None) of one MatMulInteger, or why not."""
    producer = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    if producer is None or producer.op != "DynamicQuantizeLinear":
        return "input A is not made by DynamicQuantizeLinear"
    if not isinstance(node.inputs[1], gs.Constant) or (len(node.inputs) > 3 and not isinstance(node.inputs[3], gs.Constant)):
        return f"weight '{node.inputs[1].name}' or its zero point is not a constant"
    if node.outputs[0].name in outputs:
        return "its int32 output is a graph output"
    cast = _only_consumer(node.outputs[0], "Cast")
    if cast is None or cast.outputs[0].name in outputs:
        return "its output is not cast to float by one Cast"
    mul = _only_consumer(cast.outputs[0], "Mul")
    if mul is None:
        return "the cast output is not scaled by one Mul"
    scales = next((t for t in mul.inputs if t is not cast.outputs[0]), None)
    maker = scales.inputs[0] if scales is not None and scales.inputs else None
    if maker is None or maker.op != "Mul" or producer.outputs[1] not in maker.inputs:
        return "the scale is not DynamicQuantizeLinear's scale times the weight scale"
    weight_scale = next((t for t in maker.inputs if t is not producer.outputs[1]), None)
    if not isinstance(weight_scale, gs.Constant):
        return "the weight scale is not a constant"
    return producer, mul, weight_scale


@register
class DynamicQuant(Pass):
    name = "dynamic-quant"
    description = "DynamicQuantizeLinear + MatMulInteger (quantize_dynamic) -> MatMul on DequantizeLinear(int8 weight)"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        sites = [n for n in graph.nodes if n.op == "MatMulInteger" and (n.domain or "") in ("", "ai.onnx")]
        if not sites:
            return result
        outputs = {t.name for t in graph.outputs}
        for node in sites:
            found = _match(node, outputs)
            if isinstance(found, str):
                result.misses.append(Miss(node.name, found))
                continue
            producer, mul, weight_scale = found
            weight = node.inputs[1]
            scale_shape = gu.static_shape(weight_scale)
            attrs = {"axis": len(weight.shape) - 1} if scale_shape and max(scale_shape) > 1 else {}
            e = Emit(graph, node.name)
            dq_inputs = [weight, weight_scale]
            if len(node.inputs) > 3:
                zero = node.inputs[3]
                if attrs and gu.static_shape(zero) != scale_shape:  # per-axis DQ: one zero point per scale
                    zero = e.const("zero_per_axis", np.broadcast_to(values(zero, ctx and ctx.read_values), scale_shape)
                                   .astype(gu.dtype_of(zero)))
                dq_inputs.append(zero)
            dequantized = e.make("DequantizeLinear", *dq_inputs, _dtype=weight_scale.dtype, _shape=weight.shape, **attrs)
            y = mul.outputs[0]
            mul.outputs.clear()
            graph.nodes.append(gs.Node("MatMul", e.name("matmul"), inputs=[producer.inputs[0], dequantized],
                                       outputs=[y]))
            result.rewrites += 1
        return result


def quantization_state(graph: gs.Graph) -> dict:
    """What quantisation a graph already holds: {"state": float | qdq | dynamic | qoperator, counts...}."""
    ops: dict[str, int] = {}
    for node in graph.nodes:
        ops[node.op] = ops.get(node.op, 0) + 1
    dq = [n for n in graph.nodes if n.op == "DequantizeLinear"]
    per_channel = [n for n in dq if len(n.inputs) > 1 and (gu.static_shape(n.inputs[1]) or (1,)) != ()
                   and max(gu.static_shape(n.inputs[1]) or (1,)) > 1]
    weights = sorted({str(gu.dtype_of(n.inputs[0])) for n in dq if isinstance(n.inputs[0], gs.Constant)} |
                     {str(gu.dtype_of(n.inputs[1])) for n in graph.nodes if n.op == "MatMulInteger" and isinstance(n.inputs[1], gs.Constant)})
    dynamic = {op: ops[op] for op in sorted(DYNAMIC) if op in ops}
    qoperator = {op: ops[op] for op in sorted(QOPERATOR) if op in ops}
    state = "qoperator" if qoperator else "dynamic" if dynamic else "qdq" if dq or "QuantizeLinear" in ops else "float"
    result = {"state": state}
    if state != "float":
        result.update(quantize_linear=ops.get("QuantizeLinear", 0), dequantize_linear=len(dq),
                      per_channel=len(per_channel), weight_dtypes=weights)
    if dynamic:
        result["dynamic"] = dynamic
    if qoperator:
        result["qoperator"] = qoperator
    return result
