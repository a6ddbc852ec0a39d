"""Shape and dtype inference on a weight-stripped copy of a graph.

`infer(graph, root)` sets dtype and shape on every variable it can infer. It never serialises a
weight: constants larger than 1 KiB become typed graph inputs of a throwaway copy (so the
proto stays tiny, far below 2 GB), while small constants -- the int64 shape operands, axes and
scalars that ONNX data propagation needs as VALUES to follow Shape -> Gather -> Concat ->
Reshape chains -- stay inline. Inference is ONNX's own (`data_prop=True`). Outputs of nodes
ONNX has no schema for (other domains, or ops newer than the graph's opset) keep theirs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import get_onnx_tensor_dtype, get_onnx_tensor_shape

from mtkc import graph_utils as gu

INLINE_BYTES = gu.SMALL_BYTES


def infer(graph: gs.Graph, root: Path | None = None) -> None:
    """Infer dtype/shape of every variable of `graph` in place (weights are never read)."""
    proto = stripped_proto(graph, root)
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    infos = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for name, tensor in graph.tensors().items():
        vi = infos.get(name)
        if vi is None or not isinstance(tensor, gs.Variable) or not vi.type.HasField("tensor_type"):
            continue
        if vi.type.tensor_type.elem_type:
            tensor.dtype = get_onnx_tensor_dtype(vi)
        shape = get_onnx_tensor_shape(vi)
        if shape is not None:
            tensor.shape = shape


def stripped_proto(graph: gs.Graph, root: Path | None = None) -> onnx.ModelProto:
    """A ModelProto of `graph` with big constants as typed inputs and ONNX-domain outputs untyped."""
    copy = graph.copy()
    extra_inputs = []
    for tensor in copy.tensors().values():
        if isinstance(tensor, gs.Constant) and not _inline(tensor):
            tensor.to_variable(dtype=tensor._values.dtype, shape=list(tensor.shape))
            tensor.type = "tensor_type"
            extra_inputs.append(tensor)
    kept = []
    for node in copy.nodes:
        if node.op == "Constant" and _is_onnx(node) and isinstance(node.attrs.get("value"), gs.Constant):
            value = node.attrs["value"]
            if not _inline(value):
                out = node.outputs[0]
                out.dtype, out.shape = value._values.dtype, list(value.shape)
                node.outputs.clear()
                extra_inputs.append(out)
                continue
            if gu.is_lazy(value) and value._values.tensor.data_location == onnx.TensorProto.EXTERNAL:
                from mtkc.model import read_values

                if root is None:  # cannot read it: keep its type only
                    out = node.outputs[0]
                    out.dtype, out.shape = value._values.dtype, list(value.shape)
                    node.outputs.clear()
                    extra_inputs.append(out)
                    continue
                node.attrs["value"] = gs.Constant(value.name, read_values(value, root))
        kept.append(node)
        if _has_schema(node, copy.opset):
            for out in node.outputs:
                out.dtype, out.shape = None, None
    copy.nodes = kept
    copy.inputs = [*copy.inputs, *extra_inputs]
    copy.toposort()  # ONNX inference is one forward sweep in node order
    io = {t.name for t in copy.inputs}
    for out in copy.outputs:
        if out.name not in io and isinstance(out, gs.Variable) and out.inputs and _has_schema(out.inputs[0], copy.opset):
            out.dtype, out.shape = None, None
    return gs.export_onnx(copy, do_type_check=False)


def _inline(t: gs.Constant) -> bool:
    if gu.nbytes(t) > INLINE_BYTES:
        return False
    return not (gu.is_lazy(t) and t._values.tensor.data_location == onnx.TensorProto.EXTERNAL)


def _is_onnx(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


@functools.cache
def _schema_known(op: str, domain: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, domain)
        return True
    except onnx.defs.SchemaError:
        return False


def _has_schema(node: gs.Node, opset: int) -> bool:
    """ONNX can infer this node (its op exists at the graph's opset); else keep what it has."""
    return _is_onnx(node) and _schema_known(node.op, "", int(opset))
