"""Constant access: the one way passes, patterns and capability predicates read a constant.

A constant is an initializer (`gs.Constant`) or the value of a `Constant` node, looked through
`Identity` nodes. Sizes are counted in *elements* (`max_elements`), never bytes, so "small"
means the same everywhere. Values of a lazy external weight are read only through `read`
(`Context.read_values`): nothing big is read unless a caller asks for it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

Reader = Callable[[gs.Constant], Any]
SMALL = 1 << 16  # elements: a scalar, axes, a scale, a shape operand; never a weight matrix


def constant_of(tensor: gs.Tensor) -> gs.Constant | None:
    """The constant behind `tensor`: itself, or the value of the `Constant`/`Identity` node making it."""
    for _ in range(4):
        if isinstance(tensor, gs.Constant):
            return tensor
        if len(tensor.inputs) != 1:
            return None
        node = tensor.inputs[0]
        if node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
            return node.attrs["value"]
        if node.op != "Identity":
            return None
        tensor = node.inputs[0]
    return None


def elements(const: gs.Constant) -> int:
    return math.prod(int(d) for d in const.shape or ())  # exact (numpy's int64 product wraps); 10x faster


def is_lazy(const: gs.Constant) -> bool:
    """Values not loaded yet (graphsurgeon's LazyValues: possibly external data)."""
    return isinstance(const._values, gs.ir.tensor.LazyValues)


def is_external(const: gs.Constant) -> bool:
    return is_lazy(const) and const._values.tensor.data_location == onnx.TensorProto.EXTERNAL


def values(tensor: gs.Tensor, read: Reader | None = None, max_elements: int | None = None) -> np.ndarray | None:
    """Values of the constant behind `tensor`, or None when it is none or has over `max_elements`.

    External data is read through `read`; without one it is an error naming the constant.
    """
    const = constant_of(tensor)
    if const is None or (max_elements is not None and elements(const) > max_elements):
        return None
    if is_lazy(const) and read is not None:
        return np.asarray(read(const))
    if is_external(const):
        raise ValueError(f"constant '{const.name}' has external data and no reader")
    return np.asarray(const.values)


def ints(tensor: gs.Tensor, read: Reader | None = None, max_elements: int = SMALL) -> list[int] | None:
    """A small integer constant as a flat list of ints, else None."""
    v = values(tensor, read, max_elements)
    if v is None or not np.issubdtype(v.dtype, np.integer):
        return None
    return [int(x) for x in v.reshape(-1)]


def scalar(tensor: gs.Tensor, read: Reader | None = None) -> float | None:
    """The value of a one-element numeric constant, else None."""
    v = values(tensor, read, max_elements=1)
    return None if v is None or v.size != 1 or v.dtype.kind not in "fiub" else float(v.reshape(-1)[0])


def close(vals: np.ndarray, value: float, rtol: float = 1e-6) -> bool:
    """A one-element array equal to `value` within `rtol` (exact for 0): the numeric compare."""
    return vals.size == 1 and bool(np.allclose(vals.astype(np.float64), value, rtol=rtol, atol=0))


def is_scalar(tensor: gs.Tensor, value: float, rtol: float = 1e-6, kinds: str = "fiub") -> bool:
    """`tensor` is a one-element constant of a dtype kind in `kinds` equal to `value`."""
    v = values(tensor, max_elements=1)
    return v is not None and v.dtype.kind in kinds and close(v, value, rtol)
