"""The constraint predicates of capability tables: one per constraint kind, in report priority.

Each takes (node, constraints, opset, read_values) and returns None or (reason, detail, qualifier).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.ir.constants import constant_of, elements, values

DEFAULT_DOMAIN = "ai.onnx"
CAST_LIMIT = 1024  # elements of a constant whose values are read to check they fit int32


def _dtype_name(tensor: gs.Tensor) -> str | None:
    dt = tensor.dtype
    return None if dt is None else _named(dt)


@functools.cache
def _named(dt) -> str:
    """The table's name of a dtype (numpy's or an ONNX enum): float32, int64, bfloat16, ..."""
    try:
        enum = dt if isinstance(dt, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    except (TypeError, KeyError, ValueError):
        return str(dt)
    name = onnx.TensorProto.DataType.Name(enum).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def _shape(tensor: gs.Tensor):
    return None if tensor.shape is None else tuple(tensor.shape)


def _tensors(node: gs.Node):
    """(tensor, its index, input or not) for every present input and output (`_label` names one)."""
    for i, t in enumerate(node.inputs):
        if t.name:
            yield t, i, True
    for i, t in enumerate(node.outputs):
        yield t, i, False


def _label(t: gs.Tensor, i: int, is_input: bool) -> str:
    return f"{'input' if is_input else 'output'} {i} '{t.name}'"


def _host(node, c, opset, read_values):
    host = c.get("host")
    if not host or host["input"] >= len(node.inputs):
        return None
    const = constant_of(node.inputs[host["input"]])
    if const is not None and const.shape and const.shape[0] > host["const_rows_over"]:
        return ("host-op", f"input {host['input']} '{node.inputs[host['input']].name}' is a constant table "
                f"of {const.shape[0]} rows (> {host['const_rows_over']}): a host lookup", None)
    return None


def _dtypes(node, c, opset, read_values):
    default = c.get("dtypes")
    per_input = c.get("input_dtypes", {})
    for t, i, is_input in _tensors(node):
        allowed = per_input.get(str(i), default) if is_input else default
        name = _dtype_name(t)
        if allowed is None or name is None or name in allowed:
            continue
        const = constant_of(t) if is_input and name in c.get("const_dtypes", ()) else None
        if const is None:
            return "dtype-unsupported", f"{_label(t, i, is_input)} is {name}", name
        unfit = _int32_unfit(const, read_values)
        if unfit:
            return "dtype-unsupported", f"{_label(t, i, is_input)} is a {name} constant {unfit}", name
    return None


def _int32_unfit(const: gs.Constant, read_values) -> str | None:
    """Why the converter's cast of this constant to int32 would fail, or None."""
    size = elements(const)
    if size > CAST_LIMIT:
        return f"of {size} elements (not checked)"
    try:
        vals = values(const, read_values)
    except Exception:  # unreadable external data
        return "whose values could not be read"
    info = np.iinfo(np.int32)
    bad = vals[(vals < info.min) | (vals > info.max)]
    return f"with values outside int32 ({bad.flat[0]})" if bad.size else None


def _rank(node, c, opset, read_values):
    limit = c.get("max_rank")
    if limit is None:
        return None
    for t, i, is_input in _tensors(node):
        shape = _shape(t)
        if shape is not None and len(shape) > limit:
            return "rank-unsupported", f"{_label(t, i, is_input)} has rank {len(shape)} > {limit}", None
    return None


def _static(node, c, opset, read_values):
    if not c.get("static_shapes"):
        return None
    for t, i, is_input in _tensors(node):
        shape = _shape(t)
        if shape is None:
            return "shape-dynamic", f"{_label(t, i, is_input)} has an unknown shape", None
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            return "shape-dynamic", f"{_label(t, i, is_input)} has shape [{', '.join(map(str, shape))}]", None
    return None


def _const_inputs(node, c, opset, read_values):
    for index in c.get("const_inputs", ()):
        if index < len(node.inputs) and node.inputs[index].name and constant_of(node.inputs[index]) is None:
            return "input-not-constant", f"input {index} '{node.inputs[index].name}' is computed at run time", None
    return None


def _attributes(node, c, opset, read_values):
    for name, allowed in c.get("attributes", {}).items():
        present = name in node.attrs
        if not allowed:
            if present:
                return "attribute-unsupported", f"attribute {name} is not supported", name
            continue
        value = node.attrs[name] if present else _schema_default(node, name, opset)
        if value is not None and value not in allowed:
            return "attribute-unsupported", f"attribute {name}={value!r} not in {allowed}", name
    return None


def _last_axis(node, c, opset, read_values):
    name = c.get("last_axis")
    if not name:
        return None
    shape = _shape(node.inputs[0]) if node.inputs else None
    rank = len(shape) if shape is not None else None
    if name in node.attrs:
        axes = node.attrs[name]
    elif name == "axes" and len(node.inputs) > 1 and node.inputs[1].name:
        const = constant_of(node.inputs[1])
        if const is None:
            return "input-not-constant", f"input 1 '{node.inputs[1].name}' (axes) is computed at run time", None
        try:
            axes = values(const, read_values)
        except Exception:  # unreadable external data: say so rather than guess
            return "attribute-unsupported", f"axes input '{node.inputs[1].name}' could not be read", name
    else:
        axes = _schema_default(node, name, opset)
    axes = None if axes is None else [int(a) for a in np.atleast_1d(np.asarray(axes))]
    if not axes:
        if rank == 1:
            return None
        return "attribute-unsupported", f"{name} unset: reduces over all axes, only the last axis is supported", name
    last = [-1] if rank is None else [-1, rank - 1]
    if len(axes) != 1 or axes[0] not in last:
        return "attribute-unsupported", f"{name}={axes} is not the last axis (rank {rank})", name
    return None


def _broadcast(node, c, opset, read_values):
    if c.get("broadcast") != "equal-rank":
        return None
    ranks = [(t.name, len(t.shape), constant_of(t) is not None) for t in node.inputs
             if t.name and t.shape is not None]
    live = [r for _, r, const in ranks if not const]
    top = max(live, default=None)
    for name, r, const in ranks:
        if top is not None and (r > top or (not const and r != top)):
            other = next(n for n, rr, k in ranks if not k and rr == top)
            return ("broadcast-unsupported",
                    f"inputs '{name}' (rank {r}) and '{other}' (rank {top}) differ in rank", None)
    return None


CHECKS = (_host, _rank, _dtypes, _static, _const_inputs, _attributes, _last_axis, _broadcast)


@functools.lru_cache(maxsize=None)
def _schema_attr_default(op: str, domain: str, name: str, opset: int | None):
    try:
        if opset is None:
            schema = onnx.defs.get_schema(op, domain="" if domain == DEFAULT_DOMAIN else domain)
        else:
            schema = onnx.defs.get_schema(op, opset, "" if domain == DEFAULT_DOMAIN else domain)
    except onnx.defs.SchemaError:
        return -1 if name == "axis" else None  # contrib ops (com.microsoft) default to the last axis
    attr = schema.attributes.get(name)
    if attr is None or not attr.default_value.name:
        return None
    value = onnx.helper.get_attribute_value(attr.default_value)
    return value.decode() if isinstance(value, bytes) else value


def _schema_default(node: gs.Node, name: str, opset: int | None):
    return _schema_attr_default(node.op, node.domain or DEFAULT_DOMAIN, name, opset)
