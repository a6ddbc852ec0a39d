"""int4-weights: com.microsoft MatMulNBits / GatherBlockQuantized (onnxruntime-genai `-p int4`) in opset 17.

    MatMulNBits(A, B uint8 [N, nb, blob], scales [N·nb], zero_points? uint8 packed, -, bias?)
        W[k, n] = (q[n, k] - zp[n, k // block]) · scale[n, k // block],  Y = A @ W (+ bias)
        q: `bits`-bit codes packed low nibble first; zp defaults to 2^(bits-1)
 -> codes (q - zp) int8 [nb, block, N] ─ Cast(float) ─ Mul(scales [nb, 1, N]) ─ Reshape [nb·block, N]
        ─ [Slice :K] ─ MatMul(A, ·) ─ [Add bias]
    The int4 codes and block scales stay exact in the graph (int8-held codes, fp32 scales); the
    dequantise subgraph is constant, so a converter folds it. MediaTek quantises per output
    channel: these weights reach the converter as dequantised fp32 (every value exactly q·s), and
    its --quant requantises them.

    GatherBlockQuantized(data, indices, scales, zero_points?) with gather_axis 0 (an embedding)
 -> Gather(table fp32 [V, H], indices): the table is the exactly dequantised rows (the token
    embedding runs on the host).

This pass runs after `fold`, so mtkc itself never folds the codes into float weights.
Refused (Miss): bits other than 4/8, float zero points, g_idx, GatherBlockQuantized along another axis.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.constants import values
from mtkc.ir.graph_utils import replace_uses
from mtkc.rewrite.builder import Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult, register

MS = "com.microsoft"


def _input(node: gs.Node, i: int) -> gs.Tensor | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """`bits`-bit unsigned codes packed low bits first along the last axis -> uint8 [..., count]."""
    packed = np.asarray(packed, np.uint8)
    if bits == 8:
        return packed[..., :count]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :count]


def _zero_points(node: gs.Node, index: int, rows: int, blocks: int, bits: int, ctx) -> np.ndarray | str:
    zp = _input(node, index)
    if zp is None:
        return np.full((rows, blocks), 1 << (bits - 1), np.int16)
    if not isinstance(zp, gs.Constant) or np.dtype(zp.dtype) != np.uint8:
        return "float or non-constant zero points are not decomposed"
    return unpack(values(zp, ctx.read_values).reshape(rows, -1), bits, blocks).astype(np.int16)


def _matmul_nbits(graph: gs.Graph, node: gs.Node, ctx: Context) -> str | None:
    a = node.attrs
    k, n, bits, block = int(a["K"]), int(a["N"]), int(a.get("bits", 4)), int(a["block_size"])
    if bits not in (4, 8) or _input(node, 4) is not None:
        return f"bits={bits} or g_idx is not decomposed"
    b, scales = node.inputs[1], node.inputs[2]
    if not (isinstance(b, gs.Constant) and isinstance(scales, gs.Constant)):
        return "quantized weight or scales are not constants"
    blocks = -(-k // block)
    q = unpack(values(b, ctx.read_values).reshape(n, blocks, -1), bits, block).astype(np.int16)  # [N, nb, block]
    zp = _zero_points(node, 3, n, blocks, bits, ctx)
    if isinstance(zp, str):
        return zp
    codes = np.ascontiguousarray((q - zp[:, :, None]).astype(np.int8).transpose(1, 2, 0))  # [nb, block, N]
    scale = np.asarray(values(scales, ctx.read_values), np.float32).reshape(n, blocks).T[:, None, :]  # [nb, 1, N]
    e = Emit(graph, node.name)
    f32 = np.float32
    dequant = e.op("Mul", [e.op("Cast", [e.const("codes", codes)], {"to": 1}, dtype=f32), e.const("scales", scale)],
                   dtype=f32)
    weight = e.op("Reshape", [dequant, e.ints("shape", blocks * block, n)], dtype=f32, shape=[blocks * block, n])
    if blocks * block != k:
        weight = e.op("Slice", [weight, e.ints("start", 0), e.ints("end", k), e.ints("axis", 0)], dtype=f32,
                      shape=[k, n])
    out = e.op("MatMul", [node.inputs[0], weight], dtype=f32)
    if _input(node, 5) is not None:
        out = e.op("Add", [out, node.inputs[5]], dtype=f32)
    replace_uses(graph, node.outputs[0], out)
    node.outputs.clear()
    return None


def _gather_block_quantized(graph: gs.Graph, node: gs.Node, ctx: Context) -> str | None:
    a = node.attrs
    bits, block = int(a.get("bits", 4)), int(a.get("block_size", 128))
    data, scales = node.inputs[0], node.inputs[2]
    if int(a.get("gather_axis", 0)) != 0 or bits not in (4, 8):
        return "only gather_axis 0 with 4/8-bit codes is decomposed"
    if not (isinstance(data, gs.Constant) and isinstance(scales, gs.Constant)):
        return "quantized table or scales are not constants"
    rows = values(data, ctx.read_values)
    per_row = rows.shape[-1] * (8 // bits) if np.dtype(rows.dtype) == np.uint8 else rows.shape[-1]
    if int(a.get("quantize_axis", rows.ndim - 1)) not in (-1, rows.ndim - 1) or rows.ndim != 2:
        return "only a 2-D table quantized along its last axis is decomposed"
    q = unpack(rows, bits, per_row).astype(np.int16) if np.dtype(rows.dtype) == np.uint8 else rows.astype(np.int16)
    blocks = -(-per_row // block)
    zp = _zero_points(node, 3, q.shape[0], blocks, bits, ctx)
    if isinstance(zp, str):
        return zp
    scale = np.asarray(values(scales, ctx.read_values), np.float32).reshape(q.shape[0], blocks)
    table = ((q - np.repeat(zp, block, axis=1)[:, :per_row]).astype(np.float32)
             * np.repeat(scale, block, axis=1)[:, :per_row])
    e = Emit(graph, node.name)
    out = e.op("Gather", [e.const("table", table), node.inputs[1]], {"axis": 0}, dtype=np.float32)
    replace_uses(graph, node.outputs[0], out)
    node.outputs.clear()
    return None


@register
class Int4Weights(Pass):
    name = "int4-weights"
    description = "MatMulNBits / GatherBlockQuantized -> int8-held codes + constant dequantise + MatMul / Gather"

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        handlers = {"MatMulNBits": _matmul_nbits, "GatherBlockQuantized": _gather_block_quantized}
        for node in [n for n in graph.nodes if n.domain == MS and n.op in handlers]:
            why = handlers[node.op](graph, node, ctx)
            if why is None:
                result.rewrites += 1
            else:
                result.misses.append(Miss(node.name, why))
        if result.rewrites:
            result.notes.append(f"{result.rewrites} int4 ops: weights held as int8 codes + fp32 block scales "
                                "(dequantised in-graph); embedding table dequantised to fp32")
        return result
