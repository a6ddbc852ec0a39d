"""onnxruntime sessions over a compile's graphs that share one mapping of each weights file.

Every graph of a compile (prefill, decode, each partition) points into the same `weights.bin`.
onnxruntime maps external data once per session, and a process's RSS counts a page once per
mapping, so prefill + decode counted the weights twice; a prepacked copy of every MatMul weight
per session doubled them again (measured at 0.5B dims, 2 of 24 layers: generate 1.9 GB -> 0.8 GB).
Here each external initializer is handed to onnxruntime as a view of one read-only `np.memmap`
per file (used in place, not copied), and prepacking is off (decode measured no slower; prefill
~30 % slower, a reference runtime's fair price for half the memory). Models mtkc builds in memory
from those graphs (probes, quantised copies: `model`) use the same mappings, and files under the
extra `roots` (a work folder's weights) are mapped the same way. `resident`: each file is read once
into private memory instead (same RSS; pages the kernel cannot evict and fault back in one by one
inside the runs when other jobs press on the page cache: a long run's choice, `mtkc calibrate`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mtkc.ir.execute import EXTERNAL_FOLDER_KEY, Bounded, open_session, session_options
from mtkc.ir.outdir import check_graph_file

NO_PREPACKING = "session.disable_prepacking"
STAND_IN = "mapped-elsewhere.bin"  # `model`'s sparse file named by the tensors handed from a mapping


class Sessions:
    """Sessions by path (each opened once), external weights under `root` mapped once for all."""

    def __init__(self, root: str | Path, optimize: bool = True, seconds: tuple[float, float] | None = None,
                 roots: tuple[Path, ...] = (), scratch: Path | None = None, arena: bool = True,
                 resident: bool = False):
        self.root = Path(root).resolve()
        self.roots = {self.root, *(Path(r).resolve() for r in roots)}  # folders whose files are mapped
        self.scratch = Path(scratch) if scratch is not None else None  # where `model` may put its stand-in file
        self.arena = arena  # onnxruntime's CPU arena keeps each session's peak; without it freed tensors go back
        self.optimize = optimize
        self.resident = resident  # weights files read into private memory, not mapped
        self.seconds = seconds or (None, None)  # deadlines to load, to run (default: `mtkc.ir.execute`'s)
        self._sessions: dict[Path, Bounded] = {}
        self._maps: dict[Path, np.ndarray] = {}  # a file's bytes: np.memmap, or a private copy (resident)
        self._values: list[ort.OrtValue] = []  # must outlive the sessions that use them

    def get(self, path: str | Path) -> Bounded:
        path = Path(path)
        if path not in self._sessions:
            self._sessions[path] = self._open(path)
        return self._sessions[path]

    def release(self, path: str | Path) -> None:
        """Drop the session of `path` (its graph and arena go back; the weight mappings stay)."""
        self._sessions.pop(Path(path), None)

    def _open(self, path: Path) -> Bounded:
        proto = check_graph_file(path)  # external data inside OUT and within its files, before onnxruntime reads it
        options, _ = self._options(proto, path.parent)
        return open_session(str(path), options, str(path.relative_to(self.root) if path.is_relative_to(self.root) else path),
                            *self.seconds)

    def model(self, proto: onnx.ModelProto, folder: Path, what: str) -> Bounded:
        """A session of a model mtkc built in memory from checked graphs (each call a new session);
        external locations relative to `folder`, or absolute. onnxruntime checks that the file of
        every external tensor exists inside its folder even when it is handed the values, so the
        mapped tensors point it at a sparse stand-in file in `scratch` (never read); the others it
        reads from `folder`."""
        options, mapped = self._options(proto, folder)
        handed = onnx.ModelProto()
        handed.CopyFrom(proto)
        end = 0
        for tensor in handed.graph.initializer:
            if tensor.name in mapped:
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = STAND_IN
                info = {e.key: e.value for e in tensor.external_data}
                end = max(end, int(info.get("offset", 0)) + int(info["length"]))
        if mapped:
            if self.scratch is None:
                raise ValueError("Sessions.model: mapped tensors need a scratch folder")
            stand_in = self.scratch / STAND_IN
            with open(stand_in, "ab") as f:
                if f.tell() < end:
                    f.truncate(end)
            folder = self.scratch
        options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(folder))
        return open_session(handed.SerializeToString(), options, what, *self.seconds)

    def _options(self, proto: onnx.ModelProto, folder: Path) -> tuple[ort.SessionOptions, set[str]]:
        """Session options handing onnxruntime every mapped tensor (and the names of those tensors)."""
        # basic (constant folding, redundant nodes) keeps the numbers; extended levels fuse QDQ
        # pairs into integer kernels, which a reference for NPU graphs must not do
        options = session_options(self.optimize)
        options.add_session_config_entry(NO_PREPACKING, "1")
        options.enable_cpu_mem_arena = self.arena
        mapped = set()
        for tensor in proto.graph.initializer:
            view = self.view(tensor, folder)
            if view is not None:
                value = ort.OrtValue.ortvalue_from_numpy(view)
                self._values.append(value)
                options.add_initializer(tensor.name, value)
                mapped.add(tensor.name)
        return options, mapped

    def view(self, tensor: onnx.TensorProto, folder: Path) -> np.ndarray | None:
        """The tensor's bytes in its file's mapping; None (onnxruntime loads it) when it is not a
        plain external tensor of a file directly under one of `roots` whose recorded length fits its
        shape. A file is mapped at its first use: it must not grow after that."""
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return None
        info = {e.key: e.value for e in tensor.external_data}
        file = (folder / info.get("location", "")).resolve()
        if file.parent not in self.roots or not file.is_file():
            return None
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            offset, length = int(info.get("offset", 0)), int(info["length"])
        except (KeyError, ValueError, TypeError):
            return None
        if dtype.kind not in "fiub" or math.prod(tensor.dims) * dtype.itemsize != length:
            return None
        if file not in self._maps:
            self._maps[file] = _read_only(np.fromfile(file, np.uint8)) if self.resident else np.memmap(file, mode="r")
        mapped = self._maps[file]
        if offset + length > mapped.size:
            return None  # onnxruntime reports the truncated file
        return np.ndarray(tuple(tensor.dims), dtype, buffer=mapped, offset=offset)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
