"""Save graphs with their weights in ONE external-data file shared by all of them.

    WeightWriter(out_dir, "weights.bin")         prefill.onnx ─┐
        .export(prefill_graph, root, ...)         decode.onnx  ─┼─► weights.bin (each tensor once)
        .export(decode_graph, root, ...)          part_0.onnx  ─┘
        .close()

Every constant of at least `threshold` bytes (initializers, `Constant`-node tensor attributes,
subgraphs, functions) goes to the shared file at an `align`-byte aligned offset; the `.onnx`
files only carry references, so no proto ever comes near the 2 GiB limit. Smaller constants stay
inline (a small external constant of the source model is read and inlined).

Dedup: a lazy constant still backed by the source model's data (external, or inline left in the
.onnx by `mtkc.ir.wire`) is identified first by its source (file identity, offset, length) and
copied in-kernel, in a process of its own (`mtkc.ir.copier`: the caller's next graph is built
meanwhile; each copy lands at the offset assigned when it was queued); an inline source constant
first by its TensorProto (the same object in every graph imported from one parsed file,
`mtkc.ir.model.Model.fresh`). Then every constant (folded and rewritten ones too) by its bytes:
length and a sample of head and tail pick the candidates, and only then are whole bytes hashed
(SHA-256; the stored side is read back from the weights file once its copy has landed, a source
side from its file), so unique weights are never hashed.
Output is deterministic: same graphs in the same order -> byte-identical files.

Safety: the weights file is written to a temporary name in `out_dir` and moved into place by
`close()`; on an error inside `with WeightWriter(...)` it and every graph file written are removed; a target that is a symlink, or that is one of the source files
being read, is refused (writing it would corrupt the input model). Graph files are written
to a temporary name and renamed. All graph files must live directly in `out_dir`, so the
location is a bare file name that onnxruntime, onnx and `mtkc.ir.model.load` resolve alike.
`save(graph, root, path)` is the one-graph form: weights go to `<path.name>.data`
(`model.onnx` -> `model.onnx.data`, the torch exporter's convention).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

from mtkc.errors import ExternalDataError, InputError
from mtkc.ir.copier import CHUNK, Copier, copy_error, pwrite_all
from mtkc.ir.model import constants, external_info
from mtkc.ir.opset import axes_to_attributes
from mtkc.ir.model_checks import (
    SUB_BYTE_BITS,
    external_fields,
    external_size,
    open_external,
    resolve_location,
)

SAMPLE = 4096  # bytes of head and of tail that pick dedup candidates before any full hash
LazyValues = gs.ir.tensor.LazyValues


class WeightWriter:
    """One shared weights file for several graphs; use as a context manager or call close()."""

    def __init__(self, out_dir: str | os.PathLike, filename: str = "weights.bin", *, align: int = 64, threshold: int = 1024):
        if not filename or Path(filename).name != filename or filename in (".", ".."):
            raise ValueError(f"weights file name must be a bare file name, got {filename!r}")
        self.out_dir = Path(out_dir)
        self.filename = filename
        self.path = self.out_dir / filename
        self.align = align
        self.threshold = threshold
        self._tmp: Path | None = None
        self._fd: int | None = None
        self._copier = Copier()  # the source ranges, copied while the caller goes on
        self._streams: list[tuple[Path, int]] = []  # other files whose bytes the copier writes (`stream`)
        self._closed = False
        self._graphs: list[Path] = []  # written so far; removed again by abort()
        self._end = 0
        self._by_source: dict[tuple, int] = {}  # (dev, ino, offset, length) -> offset
        self._by_tensor: dict[int, tuple] = {}  # id(inline source TensorProto) -> (it, offset, length)
        self._by_sample: dict[tuple[int, bytes], list[int]] = {}  # (length, sample digest) -> offsets not yet hashed
        self._by_digest: dict[tuple, int] = {}  # (sha256, length) -> offset
        self._source_ids: dict[tuple[str, str], tuple[int, int]] = {}  # (root, location) -> (dev, ino)
        self._target_id = _file_id(self.path)

    def __enter__(self) -> WeightWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def export(self, graph: gs.Graph, root: str | os.PathLike, path: str | os.PathLike, opset: int | None = None) -> onnx.ModelProto:
        """Write `graph` to `path` (in out_dir), its large constants to the shared file; return the proto.

        `root` is the folder the graph's lazy external constants are relative to (Model.root).
        """
        path = Path(path)
        if self._closed:
            raise ValueError(f"{self.path}: WeightWriter is closed")
        if path.parent.resolve() != self.out_dir.resolve():
            raise ValueError(f"{path}: graph files must be written directly into {self.out_dir}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        root = Path(root)
        swapped = []
        try:
            for const in constants(graph):
                ref = self._stored(const, root)
                if ref is not None:
                    swapped.append((const, const._values))
                    const._values = LazyValues(ref)
            proto = gs.export_onnx(graph, do_type_check=False)
        finally:
            for const, values in swapped:
                const._values = values
        self._copier.flush()  # this graph's copies start while the caller goes on
        if opset is not None:
            for entry in proto.opset_import:
                if entry.domain in ("", "ai.onnx"):
                    entry.version = opset
        axes_to_attributes(proto)  # the opset-17 form in a graph written at 17
        _write_atomic(path, proto.SerializeToString(deterministic=True))
        self._graphs.append(path)
        return proto

    def close(self) -> None:
        """Finish the copies, fsync and move the weights file into place (nothing is created if
        empty); on an error, `abort`."""
        self._closed = True
        try:
            self._copier.finish()
            for fd in [fd for _, fd in self._streams] + ([self._fd] if self._fd is not None else []):
                os.fsync(fd)
        except BaseException:
            self.abort()
            raise
        for _, fd in self._streams:
            os.close(fd)
        self._streams = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the partial weights file and the graph files written so far."""
        self._closed = True
        self._copier.cancel()
        for path in self._graphs:
            path.unlink(missing_ok=True)
        for path, fd in self._streams:
            os.close(fd)
            path.unlink(missing_ok=True)
        self._streams = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._tmp.unlink(missing_ok=True)

    def stream(self, path: Path, head: bytes, src: int, offset: int, nbytes: int, what: str) -> None:
        """Write `path` (a new file under out_dir, not a graph): `head`, then `nbytes` of the open
        source `src` from `offset`, copied by the copier with the weights; synced by `close`,
        removed by `abort`. `what` names the source in an error."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._streams.append((Path(path), fd))
        self._copier.put(src, fd, offset, nbytes, pwrite_all(fd, head, 0), what)
        self._copier.flush()

    # ------------------------------------------------------------------ one constant

    def _stored(self, const: gs.Constant, root: Path) -> onnx.TensorProto | None:
        """A reference TensorProto for `const` after storing its bytes, or None to leave it as is."""
        values = const._values
        if isinstance(values, gs.ir.tensor.SparseValues):
            return None
        if isinstance(values, LazyValues):
            proto = values.tensor
            if proto.data_location == onnx.TensorProto.EXTERNAL:
                return self._from_source_file(proto, root)
            if proto.data_type in SUB_BYTE_BITS or proto.data_type == onnx.TensorProto.STRING:
                return None
            known = self._by_tensor.get(id(proto))
            if known is None:  # not this very TensorProto yet (another variant may share it)
                if proto.HasField("raw_data"):
                    data = memoryview(proto.raw_data)  # a copy (protobuf): taken once per TensorProto
                elif values.nbytes < self.threshold:
                    return None
                else:
                    data = _bytes_of(onnx.numpy_helper.to_array(proto))
                if data.nbytes < self.threshold:
                    return None
                known = self._by_tensor[id(proto)] = (proto, self._offset_of(data), data.nbytes)
            return _reference(proto.name, proto.data_type, list(proto.dims), self.filename, known[1], known[2])
        array = np.asarray(values)
        if array.dtype == object or const.export_dtype != array.dtype:
            return None
        data_type = dtype_to_onnx(array.dtype)
        if data_type in SUB_BYTE_BITS:
            return None
        return self._from_memory(const.name, data_type, list(array.shape), _bytes_of(array))

    def _from_memory(self, name: str, data_type: int, dims: list[int], data: memoryview) -> onnx.TensorProto | None:
        if data.nbytes < self.threshold:
            return None
        return _reference(name, data_type, dims, self.filename, self._offset_of(data), data.nbytes)

    def _offset_of(self, data: memoryview) -> int:
        """Offset of these bytes in the weights file, appending them unless stored already."""
        return self._dedup(data.nbytes, lambda: _sample(data[:SAMPLE], data[-SAMPLE:]),
                           lambda: hashlib.sha256(data).digest(), lambda: self._append(data))

    def _dedup(self, n: int, sample, digest, append) -> int:
        """Offset of `n` bytes (sampled, hashed and appended by the callables) in the weights file."""
        key = (n, sample())
        pending = self._by_sample.get(key)
        if pending is None:  # no stored tensor can be equal: store without hashing
            self._by_sample[key] = [append()]
            return self._by_sample[key][0]
        for start in pending:  # same length and sample: hash both sides from now on
            self._copier.wait(self._fd, start + n)
            self._by_digest.setdefault((self._digest_at(self._fd, start, n), n), start)
        pending.clear()
        key = (digest(), n)
        if key not in self._by_digest:
            self._by_digest[key] = append()
        return self._by_digest[key]

    def _append(self, data: memoryview) -> int:
        start = self._aligned_end()
        self._end = start + pwrite_all(self._fd, data, start)
        return start

    @staticmethod
    def _digest_at(fd: int, start: int, nbytes: int) -> bytes:
        """SHA-256 of `nbytes` of `fd` at `start` (read in chunks)."""
        digest = hashlib.sha256()
        for at in range(start, start + nbytes, CHUNK):
            digest.update(os.pread(fd, min(CHUNK, start + nbytes - at), at))
        return digest.digest()

    def _copy(self, fd: int, offset: int, nbytes: int, what: str) -> int:
        """Where `nbytes` of the open source `fd` land; the copy itself is queued (`mtkc.ir.copier`)."""
        start = self._aligned_end()
        self._copier.put(fd, self._fd, offset, nbytes, start, what)
        self._end = start + nbytes
        return start

    def _from_source_file(self, proto: onnx.TensorProto, root: Path) -> onnx.TensorProto:
        location = external_info(proto).get("location", "")
        what = f"{root / location}: tensor '{proto.name}'"
        try:
            _, offset, _ = external_fields(proto)
            nbytes = external_size(proto)
            source = self._source_id(root, location)
            if nbytes < self.threshold:  # small: inline it
                with open_external(root, location) as f:
                    f.seek(offset)
                    raw = f.read(nbytes)
                if len(raw) != nbytes:
                    raise ExternalDataError("external data is truncated")
                inline = onnx.TensorProto(name=proto.name, data_type=proto.data_type, dims=proto.dims, raw_data=raw)
                return inline
            key = (*source, offset, nbytes)
            if key not in self._by_source:
                with open_external(root, location) as f:
                    fd, edge = f.fileno(), min(SAMPLE, nbytes)
                    self._by_source[key] = self._dedup(
                        nbytes, lambda: _sample(os.pread(fd, edge, offset), os.pread(fd, edge, offset + nbytes - edge)),
                        lambda: self._digest_at(fd, offset, nbytes),
                        lambda: self._copy(fd, offset, nbytes, what))
        except (ExternalDataError, OSError) as exc:
            raise copy_error(exc, what) from None
        return _reference(proto.name, proto.data_type, list(proto.dims), self.filename, self._by_source[key], nbytes)

    def _source_id(self, root: Path, location: str) -> tuple[int, int]:
        key = (str(root), location)
        if key not in self._source_ids:
            _, st = resolve_location(root, location)
            ident = (st.st_dev, st.st_ino)
            if ident == self._target_id:
                raise InputError(f"{self.path}: output weights file is the input's external data '{root / location}'")
            self._source_ids[key] = ident
        return self._source_ids[key]

    def _aligned_end(self) -> int:
        """The next aligned offset (the file opened first); the padding before it stays a hole, read as zeros."""
        if self._fd is None:
            self._open()
        self._end += -self._end % self.align
        return self._end

    def _open(self) -> None:
        if self.path.is_symlink():
            raise InputError(f"{self.path}: refusing to write weights through a symlink")
        self._tmp = self.out_dir / f".{self.filename}.tmp-{os.getpid()}"
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self._tmp, flags, 0o644)


def save(graph: gs.Graph, root: str | os.PathLike, path: str | os.PathLike, opset: int | None = None) -> onnx.ModelProto:
    """Write one graph to `path` with its weights in `<path.name>.data` beside it."""
    path = Path(path)
    with WeightWriter(path.parent, f"{path.name}.data") as writer:
        return writer.export(graph, root, path, opset)


def _reference(name: str, data_type: int, dims: list[int], location: str, offset: int, length: int) -> onnx.TensorProto:
    ref = onnx.TensorProto(name=name, data_type=data_type, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = ref.external_data.add()
        entry.key, entry.value = key, value
    return ref


def _bytes_of(array: np.ndarray) -> memoryview:
    """The little-endian bytes of an array, without a copy when it is already contiguous."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return memoryview(flat.view(np.uint8))


def _sample(head, tail) -> bytes:
    return hashlib.sha256(head).digest() + hashlib.sha256(tail).digest()


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _write_atomic(path: Path, data: bytes) -> None:
    if path.is_symlink():
        raise InputError(f"{path}: refusing to write a graph through a symlink")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
