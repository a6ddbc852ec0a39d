"""Values of the small integer tensors a bound graph computes from static shapes.

TorchScript exports compute shape operands at run time: `Shape(x)` → Gather/Div/Concat/Where →
the starts of a Slice, the shape of an Expand or Reshape, the bounds of a Range. ONNX's data
propagation follows only some of these ops (never Div, Where or Range), so once the inputs are
bound much of the graph stays symbolic. `known_values(graph)` evaluates them exactly, in numpy,
from the static shapes and small constants alone; shape inference then sees them as constants
(`mtkc.ir.shapes`), which types the rest in one ONNX sweep, far cheaper than onnxruntime's
symbolic inference.

Only the ops in `_OPS` are evaluated, on integer/bool values of at most `MAX_ELEMENTS`; anything
else (a value that depends on data, a float, a big tensor) is unknown.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from mtkc.ir import constants
from mtkc.ir.toposort import topo_order

MAX_ELEMENTS = 64


def known_values(graph: gs.Graph, order: list[gs.Node] | None = None) -> dict[str, np.ndarray]:
    """Output name -> value for every node output the static shapes determine (not the constants);
    `order`: `topo_order(graph)`, when the caller has it."""
    values: dict[int, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}

    def value(t: gs.Tensor) -> np.ndarray | None:
        if id(t) in values:
            return values[id(t)]
        const = constants.constant_of(t)
        if const is None:
            return None
        vals = constants.values(const, max_elements=MAX_ELEMENTS)
        return vals if vals is not None and vals.dtype.kind in "iub" else None

    for node in order or topo_order(graph):
        if node.domain not in (None, "", "ai.onnx") or len(node.outputs) != 1 or node.op not in _OPS:
            continue
        try:
            result = _OPS[node.op](node, value)
        except (ValueError, IndexError, TypeError, OverflowError, ZeroDivisionError):
            result = None  # the runtime would fail here too; leave it to its error
        if result is None:
            continue
        result = np.asarray(result)
        if result.dtype.kind in "iub" and result.size <= MAX_ELEMENTS:
            values[id(node.outputs[0])] = result
            out[node.outputs[0].name] = result
    return out


def _args(node: gs.Node, value, n: int | None = None) -> list[np.ndarray] | None:
    args = [value(t) if t.name else None for t in node.inputs]
    needed = args if n is None else args[:n]
    return None if not needed or any(a is None for a in needed) else args


def _dims(node, value) -> list | None:
    known = value(node.inputs[0])
    return list(known.shape) if known is not None else node.inputs[0].shape


def _shape(node, value):
    shape = _dims(node, value)
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    return np.array(shape, dtype=np.int64)[node.attrs.get("start", 0):node.attrs.get("end", None)]


def _size(node, value):
    shape = _dims(node, value)
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)


def _cast(node, value):
    args = _args(node, value, 1)
    to = node.attrs.get("to")
    if args is None or to not in _INT_TYPES:
        return None
    return args[0].astype(helper.tensor_dtype_to_np_dtype(to))


def _axes(node, args) -> list[int] | None:
    if "axes" in node.attrs:
        return list(node.attrs["axes"])
    if len(args) > 1 and args[1] is not None:
        return args[1].tolist()
    return None


def _squeeze(node, value):
    args = _args(node, value, 1)
    if args is None:
        return None
    axes = _axes(node, args)
    return np.squeeze(args[0]) if axes is None else np.squeeze(args[0], axis=tuple(axes))


def _unsqueeze(node, value):
    args = _args(node, value, 1)
    axes = None if args is None else _axes(node, args)
    if axes is None:
        return None
    rank = args[0].ndim + len(axes)
    return np.expand_dims(args[0], axis=tuple(sorted(a % rank for a in axes)))


def _gather(node, value):
    args = _args(node, value)
    return None if args is None else np.take(args[0], args[1], axis=node.attrs.get("axis", 0))


def _concat(node, value):
    args = _args(node, value)
    return None if args is None else np.concatenate(args, axis=node.attrs.get("axis", 0))


def _slice(node, value):
    args = _args(node, value, 3)
    if args is None or any(a is None for a in args[3:]):
        return None
    data, starts, ends = args[:3]
    axes = args[3] if len(args) > 3 else np.arange(len(starts))
    steps = args[4] if len(args) > 4 else np.ones(len(starts), dtype=np.int64)
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts.tolist(), ends.tolist(), axes.tolist(), steps.tolist()):
        index[a] = slice(s, e, st)
    return data[tuple(index)]


def _binary(fn):
    def op(node, value):
        args = _args(node, value)
        if args is None or len(args) != 2:
            return None
        return fn(args[0], args[1]).astype(np.result_type(args[0], args[1]), copy=False)
    return op


def _compare(fn):
    def op(node, value):
        args = _args(node, value)
        return None if args is None or len(args) != 2 else fn(args[0], args[1])
    return op


def _div(a, b):
    """ONNX integer Div truncates toward zero (numpy's // floors)."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def _where(node, value):
    args = _args(node, value)
    return None if args is None else np.where(args[0], args[1], args[2])


def _constant_of_shape(node, value):
    args = _args(node, value)
    fill = node.attrs.get("value")
    if args is None:
        return None
    fill = np.zeros(1, np.float32) if fill is None else np.asarray(fill.values).reshape(-1)
    if fill.dtype.kind not in "iub" or int(np.prod(args[0])) > MAX_ELEMENTS:
        return None
    return np.full(args[0].astype(np.int64), fill[0], dtype=fill.dtype)


def _range(node, value):
    args = _args(node, value)
    if args is None or args[2].reshape(()) == 0:
        return None
    start, limit, delta = (a.reshape(()) for a in args)
    if abs(int(limit) - int(start)) // abs(int(delta)) > MAX_ELEMENTS:
        return None
    return np.arange(start, limit, delta, dtype=np.result_type(*args))


def _reshape(node, value):
    args = _args(node, value)
    if args is None or node.attrs.get("allowzero", 0):
        return None
    shape = [d if d else args[0].shape[i] for i, d in enumerate(args[1].tolist())]
    return args[0].reshape(shape)


_INT_TYPES = {2, 3, 4, 5, 6, 7, 9, 12, 13}  # uint8, int8, uint16, int16, int32, int64, bool, uint32, uint64

_OPS = {
    "Shape": _shape, "Size": _size, "Cast": _cast, "Identity": lambda n, v: (_args(n, v) or [None])[0],
    "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Gather": _gather, "Concat": _concat, "Slice": _slice,
    "Add": _binary(np.add), "Sub": _binary(np.subtract), "Mul": _binary(np.multiply), "Div": _binary(_div),
    "Max": _binary(np.maximum), "Min": _binary(np.minimum),
    "Neg": lambda n, v: None if _args(n, v) is None else np.negative(_args(n, v)[0]),
    "Equal": _compare(np.equal), "Less": _compare(np.less), "Greater": _compare(np.greater),
    "Not": lambda n, v: None if _args(n, v) is None else np.logical_not(_args(n, v)[0]),
    "Where": _where, "ConstantOfShape": _constant_of_shape, "Range": _range, "Reshape": _reshape,
}
