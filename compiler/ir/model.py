"""Model I/O: load an ONNX model with weights lazy on disk, read one weight on demand.

Weights are never read at load (inline ones included, `read_proto`): graphsurgeon keeps every initializer (and every tensor
attribute, e.g. of `Constant` nodes) as `LazyValues` over the original TensorProto. Every
external-data reference is validated at load, before any pass runs (`mtkc.ir.model_checks`), so a
hostile model cannot make mtkc open a file outside its folder. Saving lives in `mtkc.ir.weights`.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs

from mtkc.display import escape
from mtkc.errors import ExternalDataError, InputError
from mtkc.ir import wire
from mtkc.ir.clone import clone, copy_message
from mtkc.ir.counts import count
from mtkc.ir.graph_utils import tensor_map
from mtkc.ir.importer import import_model
from mtkc.ir.model_checks import (
    allowed_trees,
    external_fields,
    external_size,
    open_external,
    stored_tensors,
    validate_proto,
)

PROTOBUF_LIMIT = 2**31 - 1

log = logging.getLogger("mtkc")


@dataclass
class Model:
    """A loaded model: the mutable graph plus where its external data lives."""

    graph: gs.Graph
    path: Path
    root: Path  # the folder external-data locations are relative to
    opset: int
    proto: onnx.ModelProto | None = field(default=None, repr=False)  # the parsed file `graph` came from
    names: list = field(default_factory=list, repr=False)  # [(stored TensorProto, its name in the file)]

    def fresh(self) -> Model:
        """The model as `load` gave it: its graph imported again from the parsed file, so no
        pass has touched it. Nothing is re-read or re-validated; weights stay shared and lazy.

        graphsurgeon's exporter renames a lazy constant's TensorProto in place (to the
        Constant's name), so every stored tensor gets its file name back first.
        """
        for tensor, name in self.names:
            if tensor.name != name:
                tensor.name = name
        return replace(self, graph=_import(self.proto, self.path, self.root))

    def copy(self) -> Model:
        """This model with a copy of its graph (`mtkc.ir.clone`), 2-3x faster than `fresh`.
        For a model no pass has touched yet, whose graph is still as `load` gave it: a graph that
        cannot be copied is imported again."""
        graph = clone(self.graph)
        return self.fresh() if graph is None else replace(self, graph=graph)

    def values(self, tensor: gs.Constant) -> np.ndarray:
        """Read one constant's values (from external data when it has them)."""
        return read_values(tensor, self.root)


class ExternalValues(gs.ir.tensor.LazyValues):
    """LazyValues whose `load()` reads external data from the model folder.

    Installed on every external constant at load, so `Constant.values` (and graphsurgeon's own
    folding) work on external weights; the graphsurgeon exporter still writes the reference.
    """

    def __init__(self, tensor: onnx.TensorProto, root: Path):
        super().__init__(tensor)
        self.root = root

    def load(self) -> np.ndarray:
        return _read_external(self.tensor, self.root)


def load(path: str | os.PathLike) -> Model:
    """Load `path` without reading any weight byte; validate structure and external data."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give the model's .onnx file")
    if not path.is_file():
        raise InputError(f"{path}: no such model file")
    size = path.stat().st_size
    if size > PROTOBUF_LIMIT:
        raise InputError(
            f"{path}: {size} bytes is over the 2 GiB protobuf limit; re-export with external data "
            "(torch.onnx.export(..., external_data=True))"
        )
    proto = read_proto(path)
    if not proto.HasField("graph") or not proto.graph.output or proto.ir_version <= 0:
        raise InputError(f"{path}: not an ONNX model (no graph outputs or no ir_version; truncated?)")
    root = path.parent.resolve()
    import_used_domains(proto, path)
    validate_proto(proto, path, root)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    names = [(t, t.name) for t, _, _ in stored_tensors(proto)]
    return Model(_import(proto, path, root), path, root, opset, proto, names)


def import_used_domains(proto: onnx.ModelProto, path: Path) -> None:
    """A domain the nodes use without an opset import (ORT-optimised graphs, e.g. Olive's, with
    com.microsoft ops) gets one at version 1, as onnxruntime accepts such models (logged)."""
    imported = {o.domain for o in proto.opset_import} | {"", "ai.onnx"}
    used = sorted({n.domain for n in proto.graph.node} - imported)
    for domain in used:
        proto.opset_import.append(onnx.helper.make_opsetid(domain, 1))
        log.info("mtkc: %s uses domain '%s' without an opset import; imported at version 1, as onnxruntime does",
                 path.name, escape(domain))


def read_proto(path: Path) -> onnx.ModelProto:
    """The model's proto, weights unread: big inline initializers become references into the file
    itself (`mtkc.ir.wire`) when its folder can name it as external data (not a symlink or hard
    link, no `\\` or `:` in the name); external data stays external. InputError when not ONNX."""
    st = path.lstat()
    nameable = stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and not set(path.name) & set("\\:")
    lazy = wire.parse(path) if nameable else None
    if lazy is not None:
        return lazy
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # DecodeError, RecursionError, ValueError...: all mean "not ONNX"
        raise InputError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {_first_line(exc)})") from None


def _import(proto: onnx.ModelProto, path: Path, root: Path) -> gs.Graph:
    count("graph imports")
    try:
        graph = import_model(proto)
        if graph is None:  # functions, subgraphs, ...: graphsurgeon's own import
            graph = gs.import_onnx(proto)
    except Exception as exc:  # graphsurgeon raises bare Exceptions on malformed graphs
        raise InputError(f"{path}: cannot import graph ({_first_line(exc)})") from None
    for g in (graph, *graph.functions):  # graphsurgeon hands out the file's own opset ids: copy them
        if g.import_domains is not None:
            g.import_domains = [copy_message(o) for o in g.import_domains]
    _bind_external(graph, root)
    return graph


def external_info(tensor: onnx.TensorProto) -> dict[str, str] | None:
    """The external_data key/values of a TensorProto, or None when its data is inline."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def read_values(tensor: gs.Constant, root: Path) -> np.ndarray:
    """Values of a constant; external data is read from `root` (validated again on open)."""
    lazy = tensor._values
    if isinstance(lazy, gs.ir.tensor.SparseValues) or not isinstance(lazy, gs.ir.tensor.LazyValues):
        return np.asarray(tensor.values)
    if lazy.tensor.data_location == onnx.TensorProto.EXTERNAL:
        return _read_external(lazy.tensor, root)
    return np.array(onnx.numpy_helper.to_array(lazy.tensor))


def onnxruntime_view(proto: onnx.ModelProto, root: Path) -> tuple[onnx.ModelProto, Path]:
    """(proto, folder) to hand onnxruntime for a model whose external data is under `root`.

    onnxruntime (>= 1.24) refuses data whose real path leaves the folder it is given, so a
    Hugging Face cache model (`snapshots/<rev>/x.data -> ../../blobs/<hash>`) fails. For that
    layout this returns a copy whose locations are the same logical paths spelled from the
    repository folder (`snapshots/<rev>/x.data`), and that folder. Otherwise (proto, root).
    """
    root_real = os.path.realpath(root)
    trees = allowed_trees(root_real)
    external = [t for t, _, _ in stored_tensors(proto) if t.data_location == onnx.TensorProto.EXTERNAL]
    if len(trees) == 1 or not external:
        return proto, root
    repo = os.path.dirname(trees[1])
    prefix = os.path.relpath(root_real, repo)
    view = onnx.ModelProto()
    view.CopyFrom(proto)
    for tensor, _, _ in stored_tensors(view):
        for entry in tensor.external_data if tensor.data_location == onnx.TensorProto.EXTERNAL else ():
            if entry.key == "location":
                entry.value = f"{prefix}/{entry.value}"
    return view, Path(repo)


def constants(graph: gs.Graph):
    """Every distinct Constant reachable from `graph`: initializers, node tensor attributes,
    and the same inside subgraphs and local functions, in a deterministic order."""
    seen: set[int] = set()
    stack = [graph, *reversed(graph.functions)]
    while stack:
        g = stack.pop()
        tensors = list(tensor_map(g).values())
        for node in g.nodes:
            for value in node.attrs.values():
                if isinstance(value, gs.Constant):
                    tensors.append(value)
                elif isinstance(value, gs.Graph):
                    stack.append(value)
        for t in tensors:
            if isinstance(t, gs.Constant) and id(t) not in seen:
                seen.add(id(t))
                yield t


def _bind_external(graph: gs.Graph, root: Path) -> None:
    for const in constants(graph):
        lazy = const._values
        if type(lazy) is gs.ir.tensor.LazyValues and lazy.tensor.data_location == onnx.TensorProto.EXTERNAL:
            const._values = ExternalValues(lazy.tensor, root)


def _read_external(proto: onnx.TensorProto, root: Path) -> np.ndarray:
    location = external_info(proto).get("location", "")
    try:
        _, offset, _ = external_fields(proto)
        nbytes = external_size(proto)
        with open_external(root, location) as f:
            f.seek(offset)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)
            if dtype.itemsize * int(np.prod(proto.dims, dtype=np.int64)) == nbytes:
                data = np.empty(tuple(proto.dims), dtype=dtype)  # little-endian host, like ONNX
                short = _read_into(f, memoryview(data.reshape(-1).view(np.uint8))) != nbytes
            else:  # sub-byte types: let onnx unpack them
                raw = f.read(nbytes)
                short = len(raw) != nbytes
                inline = onnx.TensorProto(name=proto.name, data_type=proto.data_type, dims=proto.dims, raw_data=raw)
                data = None if short else np.array(onnx.numpy_helper.to_array(inline))
    except (ExternalDataError, OSError) as exc:
        raise InputError(f"{root / location}: tensor '{proto.name}': {exc}") from None
    if short:
        raise InputError(f"{root / location}: tensor '{proto.name}' external data is truncated")
    return data


def _read_into(f, view: memoryview) -> int:
    """Fill `view` from `f` (one copy, straight into the array); returns the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
