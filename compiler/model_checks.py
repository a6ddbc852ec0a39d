"""Structural and external-data validation of a model proto, run at load before any pass.

Each failure is an InputError naming the file and the tensor/node; no file outside the model
folder is ever opened.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from mtkc.errors import InputError


def validate_proto(proto: onnx.ModelProto, path: Path, root: Path) -> None:
    for tensor in _external_tensors(proto.graph):
        _validate_external(tensor, path, root)


def _external_tensors(graph: onnx.GraphProto):
    yield from (t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_location == onnx.TensorProto.EXTERNAL:
                yield attr.t


def _validate_external(tensor: onnx.TensorProto, path: Path, root: Path) -> None:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    where = f"{path}: tensor '{tensor.name}'"
    if not location:
        raise InputError(f"{where} has external data without a location")
    if Path(location).is_absolute() or location.startswith(("/", "\\")):
        raise InputError(f"{where} external data location '{location}' is absolute")
    if ".." in Path(location).parts:
        raise InputError(f"{where} external data location '{location}' escapes the model folder")
    target = root / location
    if not target.is_file():
        raise InputError(f"{where} external data file '{location}' is missing")
