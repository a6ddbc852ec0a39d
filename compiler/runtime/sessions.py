"""onnxruntime sessions over a compile's graphs that share one mapping of each weights file.

Every graph of a compile (prefill, decode, each partition) points into the same `weights.bin`.
onnxruntime maps external data once per session, and a process's RSS counts a page once per
mapping, so prefill + decode counted the weights twice; a prepacked copy of every MatMul weight
per session doubled them again (measured at 0.5B dims, 2 of 24 layers: generate 1.9 GB -> 0.8 GB).
Here each external initializer is handed to onnxruntime as a view of one read-only `np.memmap`
per file (used in place, not copied), and prepacking is off (decode measured no slower; prefill
~30 % slower, a reference runtime's fair price for half the memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mtkc.ir.execute import Bounded, open_session, session_options
from mtkc.ir.outdir import check_graph_file

NO_PREPACKING = "session.disable_prepacking"


class Sessions:
    """Sessions by path (each opened once), external weights under `root` mapped once for all."""

    def __init__(self, root: str | Path, optimize: bool = True, seconds: tuple[float, float] | None = None):
        self.root = Path(root).resolve()
        self.optimize = optimize
        self.seconds = seconds or (None, None)  # deadlines to load, to run (default: `mtkc.ir.execute`'s)
        self._sessions: dict[Path, Bounded] = {}
        self._maps: dict[Path, np.memmap] = {}
        self._values: list[ort.OrtValue] = []  # must outlive the sessions that use them

    def get(self, path: str | Path) -> Bounded:
        path = Path(path)
        if path not in self._sessions:
            self._sessions[path] = self._open(path)
        return self._sessions[path]

    def _open(self, path: Path) -> Bounded:
        # basic (constant folding, redundant nodes) keeps the numbers; extended levels fuse QDQ
        # pairs into integer kernels, which a reference for NPU graphs must not do
        options = session_options(self.optimize)
        options.add_session_config_entry(NO_PREPACKING, "1")
        proto = check_graph_file(path)  # external data inside OUT and within its files, before onnxruntime reads it
        for tensor in proto.graph.initializer:
            view = self._view(tensor, path.parent)
            if view is not None:
                value = ort.OrtValue.ortvalue_from_numpy(view)
                self._values.append(value)
                options.add_initializer(tensor.name, value)
        return open_session(str(path), options, str(path.relative_to(self.root) if path.is_relative_to(self.root) else path),
                            *self.seconds)

    def _view(self, tensor: onnx.TensorProto, folder: Path) -> np.ndarray | None:
        """The tensor's bytes in its file's mapping; None (onnxruntime loads it) when it is not a
        plain external tensor of a file directly under `root` whose recorded length fits its shape."""
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return None
        info = {e.key: e.value for e in tensor.external_data}
        file = (folder / info.get("location", "")).resolve()
        if file.parent != self.root or not file.is_file():
            return None
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            offset, length = int(info.get("offset", 0)), int(info["length"])
        except (KeyError, ValueError, TypeError):
            return None
        if dtype.kind not in "fiub" or math.prod(tensor.dims) * dtype.itemsize != length:
            return None
        if file not in self._maps:
            self._maps[file] = np.memmap(file, mode="r")
        mapped = self._maps[file]
        if offset + length > mapped.size:
            return None  # onnxruntime reports the truncated file
        return np.ndarray(tuple(tensor.dims), dtype, buffer=mapped, offset=offset)
