"""Shape and dtype inference on a weight-stripped copy of a graph.

`infer(graph, root)` sets dtype and shape on every variable it can infer. It never serialises a
weight: constants larger than 1 KiB become typed graph inputs of a throwaway copy (so the
proto stays tiny, far below 2 GB), while small constants -- the int64 shape operands, axes and
scalars that ONNX data propagation needs as VALUES to follow Shape -> Gather -> Concat ->
Reshape chains -- stay inline. Inference is ONNX's own (`data_prop=True`). Outputs of nodes
ONNX has no schema for (other domains, or ops newer than the graph's opset) keep theirs.

Fallback: when every graph input is static but some tensor is still not, onnxruntime's symbolic
shape inference runs on the same stripped copy (`finish`): it follows the Shape/Gather/Concat/
Expand chains of TorchScript exports that ONNX data propagation gives up on, and knows the
com.microsoft ops. It only fills shapes that are still not static.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx
from onnx_graphsurgeon.importers.onnx_importer import get_onnx_tensor_dtype

from mtkc.errors import InputError
from mtkc.ir import constants, shape_values
from mtkc.ir.counts import count
from mtkc.ir.graph_utils import plain, tensor_map
from mtkc.ir.toposort import topo_order

INLINE_ELEMENTS = 128  # constants copied into the shape-inference model (shape operands)
PROPAGATE_ELEMENTS = 1 << 20  # a constant Range ONNX's data propagation would spell out, value by value
MAX_ELEMENTS = 1 << 31  # one tensor: more elements cannot be indexed with int32
VALUE_ROUNDS = 3  # sweeps with the shape operands' values (each can make more of them static)
SYMBOLIC_ROUNDS = 8  # passes of onnxruntime's symbolic inference (LLM exports settle in 1-2)
log = logging.getLogger(__name__)


def infer(graph: gs.Graph, root: Path | None = None) -> None:
    """Infer dtype/shape of every variable of `graph` in place (weights are never read)."""
    count("shape inferences")
    small = _announced_ranges(graph) <= PROPAGATE_ELEMENTS  # data propagation computes them (2^40: never ends)
    order = topo_order(graph)  # inference adds no node: one order serves every sweep
    base = stripped_proto(graph, root, order)
    tensors = tensor_map(graph)  # inference names nothing: one map serves every sweep
    _onnx_infer(tensors, base, small)
    before = None
    for _ in range(VALUE_ROUNDS if all(_static(t) for t in graph.inputs) else 0):
        loose = sum(1 for t in tensors.values() if not _static(t))
        if not loose or loose == before:
            break
        before = loose  # shape operands computed from the bound shapes, as constants of one more sweep
        known = shape_values.known_values(graph, order)
        small = _announced_ranges(graph, known) <= PROPAGATE_ELEMENTS  # bounds that are known now count too
        _onnx_infer(tensors, _with_values(base, known), small, known)
    finish(graph, root, tensors)


def _with_values(base: onnx.ModelProto, known: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`base` (a stripped proto) with the nodes making `known` outputs replaced by initializers of their values.

    Field by field: a whole copy would hold every node twice at the peak of a compile."""
    g = base.graph
    graph = onnx.GraphProto(name=g.name, input=g.input, output=g.output, initializer=g.initializer,
                            value_info=g.value_info)
    graph.node.extend(n for n in g.node if not (n.output and n.output[0] in known))
    graph.initializer.extend(onnx.numpy_helper.from_array(v, name) for name, v in known.items())
    return onnx.ModelProto(ir_version=base.ir_version, opset_import=base.opset_import, graph=graph)


def _onnx_infer(tensors: dict[str, gs.Tensor], proto: onnx.ModelProto, data_prop: bool,
                known: dict[str, np.ndarray] | None = None) -> None:
    """ONNX's inference on `proto`, a stripped copy of the graph whose `tensor_map` is `tensors`;
    `known`: node outputs it sees as constants of these values (a sweep after the first, which
    leaves the tensors it typed static as they are: more values only refine the rest)."""
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=data_prop)
    infos = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    types: dict[bytes, tuple | None] = {}  # the layers of an LLM repeat their value types
    for name, vi in infos.items():
        tensor = tensors.get(name)
        if tensor is None or not isinstance(tensor, gs.Variable):
            continue
        if known is not None and tensor.dtype is not None and _static(tensor):
            continue
        key = vi.type.SerializeToString()
        if key not in types:
            types[key] = _value_type(vi.type)
        if types[key] is None:
            continue
        dtype, shape = types[key]
        if dtype is not None:
            _set(tensor, "dtype", dtype)
        if shape is not None:
            _set(tensor, "shape", list(shape))
    for name, value in (known or {}).items():
        tensor = tensors[name]
        tensor.dtype, tensor.shape = value.dtype, list(value.shape)


_set = object.__setattr__  # graphsurgeon's Tensor.__setattr__ adds nothing for dtype/shape; this runs per tensor


def _value_type(type_proto: onnx.TypeProto) -> tuple | None:
    """(dtype or None, dims or None) as graphsurgeon's importer reads a tensor type; None for
    another type."""
    if not type_proto.HasField("tensor_type"):
        return None
    typed = type_proto.tensor_type
    dtype = _dtype(typed.elem_type) if typed.elem_type else None
    if not typed.HasField("shape"):
        return dtype, None
    return dtype, tuple(d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
                        for d in typed.shape.dim)


@functools.cache
def _dtype(elem_type: int):
    """graphsurgeon's dtype of a tensor-typed value info of this element type (numpy's, or the ONNX enum)."""
    return get_onnx_tensor_dtype(onnx.helper.make_tensor_value_info("t", elem_type, None))


def _announced_ranges(graph: gs.Graph, known: dict[str, np.ndarray] | None = None) -> int:
    """Elements of the largest Range with constant (or `known`) bounds; InputError past MAX_ELEMENTS
    (nothing runs)."""
    known = known or {}

    def bound(t: gs.Tensor) -> float | None:
        value = known.get(t.name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else constants.scalar(t)

    largest = 0
    for node in graph.nodes:
        if node.op != "Range" or len(node.inputs) != 3:
            continue
        bounds = [bound(t) for t in node.inputs]
        if None in bounds or bounds[2] == 0 or not all(math.isfinite(b) for b in bounds):
            continue
        start, limit, delta = bounds
        count = max(0, math.ceil((limit - start) / delta))
        if count > MAX_ELEMENTS:
            raise InputError(f"node '{node.name}' (Range): {count} elements from {start:g} to {limit:g} step {delta:g} "
                             f"(at most 2^31)")
        largest = max(largest, count)
    return largest


def finish(graph: gs.Graph, root: Path | None, tensors: dict[str, gs.Tensor]) -> None:
    """onnxruntime's symbolic shape inference for what ONNX left non-static, when the inputs are
    static (`tensors`: the graph's `tensor_map`)."""
    if not all(_static(t) for t in graph.inputs) or all(_static(t) for t in tensors.values()):
        return
    count("symbolic shape inferences")
    try:
        inferred = _symbolic_infer(stripped_proto(graph, root))
    except Exception as exc:  # it raises bare Exceptions on ops it cannot handle
        log.debug("symbolic shape inference failed: %s", exc)
        return
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        t = tensors.get(vi.name)
        if isinstance(t, gs.Variable) and not _static(t) and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                t.shape = [d.dim_value for d in dims]
                if t.dtype is None and vi.type.tensor_type.elem_type:
                    t.dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)


def _symbolic_infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`SymbolicShapeInference.infer_shapes` minus its failure path, which saves the model to the
    working directory and raises: the tensors typed before the first op it cannot handle are kept."""
    sym = symbolic_shape_inference()(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    sym._preprocess(proto)
    for _ in range(SYMBOLIC_ROUNDS):  # it repeats while a merge changed a dim; a broken graph can cycle
        if not sym.run_:
            break
        sym._infer_impl()
    sym._update_output_from_vi()
    return sym.out_mp_


def retype(graph: gs.Graph, changed: Iterable[gs.Node]) -> bool:
    """What `infer` would give after dtype edits at the inputs or attributes of the `changed` nodes
    of a graph that was `settled` before them (shapes stay): ONNX's inference node by node, from
    `changed` downstream while an output's dtype changes, in topological order. Nodes ONNX has no
    schema for keep their outputs, as in `infer`. False, with every tensor as it was, when a node
    cannot be inferred alone (an input without a dtype, a subgraph, ONNX's error): run `infer`."""
    opset = int(graph.opset)
    nodes = topo_order(graph)
    order = {id(n): i for i, n in enumerate(nodes)}
    heap = sorted({order[id(n)] for n in changed if id(n) in order})
    queued = set(heap)
    edits: list[tuple[gs.Variable, object, object]] = []
    imports = _opset_imports(graph)
    while heap:
        node = nodes[heapq.heappop(heap)]
        if not _has_schema(node, opset):
            continue
        inferred = _node_types(node, opset, imports)
        if inferred is None:
            for t, dtype, shape in reversed(edits):
                t.dtype, t.shape = dtype, shape
            return False
        for t in node.outputs:
            typed = inferred.get(t.name)
            if not isinstance(t, gs.Variable) or typed is None or not typed[0] or typed[0] == t.dtype:
                continue
            edits.append((t, t.dtype, t.shape))
            t.dtype = typed[0]
            if not _static(t) and typed[1] is not None and all(isinstance(d, int) for d in typed[1]):
                t.shape = list(typed[1])
            for c in t.outputs:
                i = order.get(id(c))
                if i is not None and i not in queued:
                    queued.add(i)
                    heapq.heappush(heap, i)
    count("retypes")
    return True


def _node_types(node: gs.Node, opset: int, imports: list) -> dict[str, tuple] | None:
    """{output name: (dtype, dims)} of one ONNX node by ONNX's inference from its inputs' types
    (and small constants' values); None when it cannot be inferred alone."""
    if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return None
    types, data = {}, {}
    for t in node.inputs:
        if not t.name:
            continue
        if t.dtype is None or t.shape is None:
            return None
        if isinstance(t, gs.Constant) and _inline(t):
            data[t.name] = OnnxExporter.export_tensor_proto(t)
        types[t.name] = onnx.helper.make_tensor_type_proto(dtype_to_onnx(t.dtype), list(t.shape))
    try:
        schema = onnx.defs.get_schema(node.op, opset, "")
        out = onnx.shape_inference.infer_node_outputs(schema, OnnxExporter.export_node(node), types, data,
                                                      opset_imports=imports)
    except Exception:  # ONNX's inference or schema errors: the whole-graph inference decides
        return None
    return {name: value for name, vt in out.items() if (value := _value_type(vt)) is not None}


def settled(graph: gs.Graph) -> bool:
    """Every node output has a dtype and a static shape: `infer` would add nothing to them."""
    return all(t.dtype is not None and _static(t) for node in graph.nodes for t in node.outputs)


def _static(t: gs.Tensor) -> bool:
    if isinstance(t, gs.Constant):
        return True
    if t.shape is None:
        return False
    for d in t.shape:  # a loop, not all(<generator>): this runs for every tensor, several times per inference
        if not isinstance(d, int):
            return False
    return True


def stripped_proto(graph: gs.Graph, root: Path | None = None, order: list[gs.Node] | None = None) -> onnx.ModelProto:
    """A ModelProto of `graph` with big constants as typed inputs and ONNX-domain outputs untyped.

    Built node by node from `graph` (no copy of the graph; nothing in it changes), in
    topological order (`order`: `topo_order(graph)`, when the caller has it): ONNX inference is
    one forward sweep in node order. The nodes are made in place in the proto (as graphsurgeon's
    `export_node` makes them), not copied into it twice as `make_graph` and `make_model` would.
    """
    proto = onnx.ModelProto(ir_version=onnx.IR_VERSION if graph.ir_version is None else graph.ir_version)
    proto.opset_import.extend(_opset_imports(graph))
    g = proto.graph
    g.name = graph.name
    io = {t.name for t in graph.inputs}
    inputs = [OnnxExporter.export_value_info_proto(t, False) for t in graph.inputs]
    initializers, value_info = [], []
    done = set(io)

    def typed_input(name: str, const: gs.Constant) -> None:
        inputs.append(onnx.helper.make_tensor_value_info(name, dtype_to_onnx(const._values.dtype), list(const.shape)))
        done.add(name)

    def constant(t: gs.Constant) -> None:
        if t.name in done or not t.name:
            return
        if _inline(t):
            initializers.append(OnnxExporter.export_tensor_proto(t))
            done.add(t.name)
        else:
            typed_input(t.name, t)

    for node in order or topo_order(graph):
        value = node.attrs.get("value")
        if node.op == "Constant" and _is_onnx(node) and isinstance(value, gs.Constant) and not _inline(value):
            if node.outputs:
                typed_input(node.outputs[0].name, value)
            continue
        for t in node.inputs:
            if isinstance(t, gs.Constant):
                constant(t)
        n = g.node.add(op_type=node.op, name=node.name or None, domain=node.domain)
        n.input.extend([t.name for t in node.inputs])
        n.output.extend([t.name for t in node.outputs])
        if node.attrs:
            n.attribute.extend(OnnxExporter.export_attributes(node.attrs))
        if not _has_schema(node, graph.opset):
            value_info += [OnnxExporter.export_value_info_proto(t, False) for t in node.outputs
                           if isinstance(t, gs.Variable) and t.name and (t.dtype is not None or t.shape is not None)]
    outputs = []
    for out in graph.outputs:
        if isinstance(out, gs.Constant):
            constant(out)
        if out.name not in io and isinstance(out, gs.Variable) and out.inputs and _has_schema(out.inputs[0], graph.opset):
            outputs.append(onnx.helper.make_empty_tensor_value_info(out.name))
        else:
            outputs.append(OnnxExporter.export_value_info_proto(out, False))
    names = {vi.name for vi in outputs}
    g.input.extend(inputs)
    g.output.extend(outputs)
    g.initializer.extend(initializers)
    g.value_info.extend(vi for vi in value_info if vi.name not in names)
    return proto


def _opset_imports(graph: gs.Graph) -> list:
    """graphsurgeon's opset imports (its `update_import_domains`), without changing `graph`."""
    imports = list(graph.import_domains or [onnx.helper.make_opsetid("", graph.opset)])
    known = {o.domain for o in imports}
    used = {n.domain for n in graph.nodes}
    if not plain(graph):
        used |= {n.domain for g in graph.subgraphs(recursive=True) for n in g.nodes}
    for domain in sorted(d for d in used - known if d is not None):
        imports.append(onnx.helper.make_opsetid(domain, 1))
    return imports


def _inline(t: gs.Constant) -> bool:
    return constants.elements(t) <= INLINE_ELEMENTS and not constants.is_external(t)


def _is_onnx(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


@functools.cache
def _schema_known(op: str, domain: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, domain)
        return True
    except onnx.defs.SchemaError:
        return False


def _has_schema(node: gs.Node, opset: int) -> bool:
    """ONNX can infer this node (its op exists at the graph's opset); else keep what it has."""
    return _is_onnx(node) and _schema_known(node.op, "", int(opset))


def symbolic_shape_inference() -> type:
    """onnxruntime's `SymbolicShapeInference` class, loaded without running the `onnxruntime.tools`
    package `__init__` (which imports torch when installed: ~300 MB and seconds for nothing)."""
    import importlib.util
    import sys

    import onnxruntime

    name = "onnxruntime.tools.symbolic_shape_infer"
    module = sys.modules.get(name)
    if module is None:
        path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module.SymbolicShapeInference
