"""A partition quantised at any size: its weights read from their mapping, one tensor at a time.

onnxruntime.quantization holds a model's weights in Python (twice while it calibrates): beside the
float pipeline that is three copies of a 2 GB partition at 0.5B. Here it only sees the graph:

    ranges   the float partition (weights mapped once, `Sessions`) run over the samples with a
             ReduceMin/ReduceMax of every tensor onnxruntime's MinMax calibrator selects: its
             calibration cache, the same figures
    stubbed  the partition with every per-channel weight a [1, .., C, .., 1] stand-in (its channel
             axis only) and the other constants inline ─► quantize_static (QDQ; ranges from the cache)
    codes    each weight read from its mapping in blocks and quantised on its channel scales as
             onnxruntime's `quantize_onnx_initializer` does, written to a file of the work folder
             (made once for every graph and precision) in the stand-in's place; int4 codes travel in
             int8 (DequantizeLinear gives the same products); a stand-in left float (a node kept
             float) gets its weight back.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from mtkc.runtime.sessions import Sessions

BLOCK = 1 << 22  # elements of a weight read from its mapping at a time (16 MiB of float32)
ALIGN = 4096  # offsets of written tensors (page-aligned: mapped in place)
CODE_TYPES = {16: onnx.TensorProto.INT16, 8: onnx.TensorProto.INT8, 4: onnx.TensorProto.INT8}  # int4 in int8


class Writer:
    """A new file of the work folder, written once (then mapped): tensors appended as external data."""

    def __init__(self, path: Path):
        self.path, self.file, self.offset = path, None, 0

    def add(self, name: str, data_type: int, dims: list[int], blocks: Iterable[np.ndarray]) -> onnx.TensorProto:
        if self.file is None:
            self.file = open(self.path, "wb")
        start = -(-self.offset // ALIGN) * ALIGN
        self.file.write(b"\0" * (start - self.offset))
        length = 0
        for block in blocks:
            data = np.ascontiguousarray(block).tobytes()
            self.file.write(data)
            length += len(data)
        self.offset = start + length
        tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", str(self.path)), ("offset", str(start)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        return tensor

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Store:
    """The mappings of OUT's weights and of the files written to `folder` (one `Sessions` for every
    session of the simulation), each weight's channel absmax and codes, made once."""

    def __init__(self, out: Path, folder: Path):
        self.folder = Path(folder)
        # no arena: every quantised session dequantises its weights as it runs (the LM head's alone is
        # 0.5 GB at 0.5B); an arena per session would keep each one's peak
        self.sessions = Sessions(out, optimize=False, roots=(self.folder,), scratch=self.folder, arena=False)
        self._absmax: dict[tuple, np.ndarray] = {}
        self._codes: dict[tuple, onnx.TensorProto] = {}
        self._files = itertools.count()

    def writer(self) -> Writer:
        return Writer(self.folder / f"tensors{next(self._files)}.bin")

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's values: a view of its mapping when external (locations are absolute), else its own."""
        view = self.sessions.view(tensor, self.folder)
        return view if view is not None else numpy_helper.to_array(tensor)

    def absmax(self, tensor: onnx.TensorProto, axis: int) -> np.ndarray:
        key = (_where(tensor), axis)
        if key not in self._absmax:
            self._absmax[key] = channel_absmax(self.array(tensor), axis)
        return self._absmax[key]

    def codes(self, tensor: onnx.TensorProto, axis: int, bits: int, writer: Writer) -> onnx.TensorProto:
        """The tensor's codes on MediaTek's grid (`grid_scales`), as an external int tensor."""
        key = (_where(tensor), axis, bits)
        if key not in self._codes:
            scales = grid_scales(self.absmax(tensor, axis), bits)
            self._codes[key] = writer.add(tensor.name, CODE_TYPES[bits], list(tensor.dims),
                                          quantised(self.array(tensor), axis, scales, bits))
        return self._codes[key]


def _where(tensor: onnx.TensorProto) -> tuple:
    info = {e.key: e.value for e in tensor.external_data}
    return (info.get("location"), info.get("offset"), tuple(tensor.dims)) if info else (tensor.name, tuple(tensor.dims))


def grid_scales(absmax: np.ndarray, bits: int) -> np.ndarray:
    """Per-channel scales on MediaTek's grid (torch's symmetric observer): codes in [-2^(b-1), 2^(b-1)-1],
    scale = absmax / ((qmax - qmin) / 2). onnxruntime's own symmetric int8/16 range drops the lowest
    code (scale absmax/127), a different grid."""
    scales = absmax / ((2 ** bits - 1) / 2)
    return np.where(scales > 0, scales, 1.0).astype(np.float32)


def _blocks(view: np.ndarray) -> Iterator[slice]:
    rows = max(1, BLOCK // max(1, int(np.prod(view.shape[1:]))))
    return (slice(i, i + rows) for i in range(0, view.shape[0], rows))


def channel_absmax(view: np.ndarray, axis: int) -> np.ndarray:
    """max |w| over everything but `axis`, read in blocks of rows (the view may be a mapping)."""
    others = tuple(a for a in range(view.ndim) if a != axis)
    parts = [np.abs(view[rows]).max(axis=others) for rows in _blocks(view)]
    return np.concatenate(parts) if axis == 0 else np.max(parts, axis=0)


def quantised(view: np.ndarray, axis: int, scales: np.ndarray, bits: int) -> Iterator[np.ndarray]:
    """The codes of `view` in C order, block by block: round(w / scale) clipped to the signed `bits`
    range, float32 arithmetic as onnxruntime's `quantize_nparray` (zero point 0)."""
    shape = [1] * view.ndim
    shape[axis] = -1
    scale = scales.reshape(shape)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    dtype = np.int16 if bits == 16 else np.int8
    for rows in _blocks(view):
        s = scale[rows] if axis == 0 else scale
        codes = np.asarray((view[rows].astype(np.float32) / s).round())
        np.clip(codes, low, high, out=codes)
        yield codes.astype(dtype)


def absolute(proto: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """`proto` with every external location spelled as an absolute path (it is a model held in
    memory, its tensors in more than one folder)."""
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str((Path(folder) / entry.value).resolve())
    return proto


def calibration_tensors(proto: onnx.ModelProto) -> list[tuple[str, int]]:
    """(name, elem type) of the tensors onnxruntime's MinMax calibrator calibrates with every op type
    selected (`CalibraterBase.select_tensors_to_calibrate`): float inputs and outputs of every node
    with a known type, initializers excluded."""
    graph = onnx.shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type for v in itertools.chain(graph.value_info, graph.output, graph.input)}
    constants = {t.name for t in proto.graph.initializer}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    found: dict[str, int] = {}
    for node in proto.graph.node:
        for name in itertools.chain(node.input, node.output):
            t = types.get(name)
            if t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type in floats and name not in constants:
                found.setdefault(name, t.tensor_type.elem_type)
    return sorted(found.items())


def ranges(proto: onnx.ModelProto, open_session: Callable[[onnx.ModelProto], object], feeds: Iterable[dict]):
    """onnxruntime's MinMax `TensorsData` of the float model over `feeds` (min and max over every
    sample of every calibrated tensor), its weights where `open_session` maps them."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

    tensors = calibration_tensors(proto)
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    del probe.graph.output[:]
    names = []
    for k, (name, elem) in enumerate(tensors):
        for op in ("ReduceMin", "ReduceMax"):
            result = f"mtkc_range_{k}_{op}"
            probe.graph.node.append(onnx.helper.make_node(op, [name], [result], keepdims=1))
            probe.graph.output.append(onnx.helper.make_tensor_value_info(result, elem, None))
            names.append(result)
    session = open_session(probe)
    low: dict[str, np.ndarray] = {}
    high: dict[str, np.ndarray] = {}
    for feed in feeds:
        values = session.run(names, feed)
        for k, (name, _) in enumerate(tensors):
            lo, hi = values[2 * k].reshape(-1), values[2 * k + 1].reshape(-1)
            low[name] = np.minimum(low[name], lo) if name in low else lo
            high[name] = np.maximum(high[name], hi) if name in high else hi
    if not low:
        raise ValueError("no calibration sample")
    return TensorsData(CalibrationMethod.MinMax, {n: (low[n], high[n]) for n, _ in tensors})


def stubbed(proto: onnx.ModelProto, weights: dict[str, int], store: Store) -> onnx.ModelProto:
    """A copy of `proto` for onnxruntime.quantization: each of `weights` (name -> channel axis) a
    zero stand-in keeping only its channel axis, every other external constant inline."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for tensor in copy.graph.initializer:
        if tensor.name in weights:
            dims = [1] * len(tensor.dims)
            dims[weights[tensor.name]] = tensor.dims[weights[tensor.name]]
            stand_in = numpy_helper.from_array(np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)), tensor.name)
            tensor.CopyFrom(stand_in)
        elif tensor.data_location == onnx.TensorProto.EXTERNAL:
            tensor.CopyFrom(numpy_helper.from_array(np.array(store.array(tensor)), tensor.name))
    return copy


def with_codes(quantised_proto: onnx.ModelProto, float_proto: onnx.ModelProto, weights: dict[str, int],
               bits_of: Callable[[int], int], store: Store) -> onnx.ModelProto:
    """The quantised stand-in model with each weight's real codes (DequantizeLinear's input, its zero
    point in the codes' type) and the weights left float back in place."""
    from onnxruntime.quantization.quant_utils import add_dequant_output_suffix

    originals = {t.name: t for t in float_proto.graph.initializer if t.name in weights}
    tensors = {t.name: t for t in quantised_proto.graph.initializer}
    dequantised = {add_dequant_output_suffix(name): name for name in weights}
    writer = store.writer()
    try:
        for node in quantised_proto.graph.node:
            name = dequantised.get(node.output[0]) if node.op_type == "DequantizeLinear" and node.output else None
            if name is None:
                continue
            stand_in = tensors[node.input[0]]
            code = store.codes(originals[name], weights[name], bits_of(stand_in.data_type), writer)
            stand_in.CopyFrom(onnx.TensorProto(name=stand_in.name, data_type=code.data_type, dims=code.dims,
                                               data_location=code.data_location, external_data=code.external_data))
            zero = tensors.get(node.input[2]) if len(node.input) > 2 else None
            if zero is not None and zero.data_type != code.data_type:
                values = numpy_helper.to_array(zero).astype(onnx.helper.tensor_dtype_to_np_dtype(code.data_type))
                zero.CopyFrom(numpy_helper.from_array(values, zero.name))
    finally:
        writer.close()
    for name, original in originals.items():
        if name in tensors:
            tensors[name].CopyFrom(original)
    return quantised_proto
