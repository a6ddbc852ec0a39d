"""Model I/O: load an ONNX model with weights lazy on disk, read one weight on demand, save.

Weights are never read at load: graphsurgeon keeps every initializer as `LazyValues` over the
original TensorProto. Every external-data reference is validated at load (before any pass runs),
so a hostile model cannot make mtkc open a file outside its folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError

from mtkc.errors import InputError

PROTOBUF_LIMIT = 2**31 - 1


@dataclass
class Model:
    """A loaded model: the mutable graph plus where its external data lives."""

    graph: gs.Graph
    path: Path
    root: Path  # the folder external-data locations are relative to
    opset: int
    proto_bytes: int  # size of the .onnx file itself (weights excluded when external)

    def values(self, tensor: gs.Constant) -> np.ndarray:
        """Read one constant's values (from external data when it has them)."""
        return read_values(tensor, self.root)


def load(path: str | os.PathLike) -> Model:
    """Load `path` without reading any weight byte; validate structure and external data."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such model file")
    size = path.stat().st_size
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise InputError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {_first_line(exc)})") from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise InputError(f"{path}: not an ONNX model (no graph)")
    root = path.parent.resolve()
    from mtkc.model_checks import validate_proto  # hardening lives in its own module

    validate_proto(proto, path, root)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    try:
        graph = gs.import_onnx(proto)
    except Exception as exc:  # graphsurgeon raises bare Exceptions on malformed graphs
        raise InputError(f"{path}: cannot import graph ({_first_line(exc)})") from None
    return Model(graph=graph, path=path, root=root, opset=opset, proto_bytes=size)


def external_info(tensor: onnx.TensorProto) -> dict[str, str] | None:
    """The external_data key/values of a TensorProto, or None when its data is inline."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def read_values(tensor: gs.Constant, root: Path) -> np.ndarray:
    """Values of a constant; external data is read from `root` (already validated at load)."""
    lazy = tensor._values
    if not isinstance(lazy, gs.ir.tensor.LazyValues):
        return np.asarray(tensor.values)
    proto = lazy.tensor
    info = external_info(proto)
    if info is None:
        return np.array(onnx.numpy_helper.to_array(proto))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)
    offset = int(info.get("offset", 0))
    count = int(np.prod(proto.dims, dtype=np.int64))
    with open(root / info["location"], "rb") as f:
        f.seek(offset)
        data = np.fromfile(f, dtype=dtype, count=count)
    if data.size != count:
        raise InputError(f"{root / info['location']}: tensor '{proto.name}' external data is truncated")
    return data.reshape(tuple(proto.dims))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
