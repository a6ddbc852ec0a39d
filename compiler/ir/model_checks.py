"""Validation of a model proto at load, before any pass runs: external data, then structure.

Every failure is an InputError with one line naming the file and the tensor/node.

External data (initializers, sparse initializers, tensor attributes of any node - `Constant`
as optimum writes it - in the main graph, all subgraphs and local functions):
  * metadata: `location` present; `offset`/`length` non-negative decimal integers; unknown
    keys are logged and ignored (never used as attribute names);
  * `location` is relative (no `/x`, `\\x`, `C:x`) and has no `..` component. Both are
    decided on the string, before the file system is touched, so a traversal never turns into a
    "file not found" and no path outside the model folder is ever stat'ed or opened;
  * the path is resolved one component at a time (`resolve_location`), the way the kernel does,
    and every step is checked for containment BEFORE it is `lstat`-ed. Symlinks are followed
    only while they stay inside an allowed tree:
      - the model folder (its real path), and
      - Hugging Face cache layout: when the model folder lies in `<repo>/snapshots/<rev>/...`,
        also `<repo>/blobs/` (hub files are symlinks `snapshots/<rev>/f -> ../../blobs/<hash>`).
    `<repo>` is found from the folder's own path (nearest ancestor followed by `snapshots/<rev>`),
    not by probing the disk. A symlink (relative or absolute target) ending outside both, or a
    sub-folder symlinked elsewhere, is refused before anything outside is looked at;
  * the target is a regular file with one hard link: a second link can alias any file of the
    user's (e.g. a key) from inside the folder and nothing on disk tells where the other name
    is, so mtkc refuses it as onnx >= 1.21 does;
  * `offset + length` (length defaults to the tensor's size) lies within the file, and an
    explicit length equals the tensor's size. No byte of the file is read.
Each distinct location is resolved once, so this is linear in the number of tensors.

Inline data: `raw_data` length (or the typed field's element count) matches the shape. (A big
inline initializer arrives here as an external reference into the model file: `mtkc.ir.wire`.)

ONNX validity (`check_onnx`): onnx.checker on a weight-stripped copy of the proto (no weight byte
read or copied): duplicate initializer names, missing or mistyped attributes, a Cast without
`to`, ... are refused with the checker's reason, as onnxruntime would refuse them. Also refused:
sparse initializers (no pass reads them), default-domain opsets onnxruntime cannot run (< 7), and
external-data forms onnxruntime rejects (a repeated key, `basepath`, a location ending in `/`).
A domain used without an opset import (Olive's com.microsoft ops) is checked at version 1, as
onnxruntime runs it (`mtkc.ir.model.load` imports it, so the graphs written carry it).

Structure: subgraph nesting <= 32 (onnxruntime's cap); every node input is produced by a graph
input, an initializer, an earlier-or-later node output or an enclosing scope ("" is an absent
optional); every tensor name is produced once; no cycles (Kahn's algorithm, subgraph free
variables counted as inputs of their node); graph outputs are produced.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import onnx

from mtkc.errors import ExternalDataError, InputError
from mtkc.ir.toposort import cycle_node, kahn_order

log = logging.getLogger("mtkc")

MAX_SUBGRAPH_DEPTH = 32
MAX_SYMLINKS = 40
KNOWN_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})
_DECIMAL = re.compile(r"[0-9]{1,20}")
_TENSOR_ATTRS = (onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS)
_SPARSE_ATTRS = (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS)
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
SUB_BYTE_BITS = {
    getattr(onnx.TensorProto, n): bits
    for n, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if hasattr(onnx.TensorProto, n)
}
_TYPED_FIELD = {  # data_type -> (typed field, values per element) when raw_data is absent
    onnx.TensorProto.FLOAT: ("float_data", 1),
    onnx.TensorProto.DOUBLE: ("double_data", 1),
    onnx.TensorProto.INT64: ("int64_data", 1),
    onnx.TensorProto.UINT32: ("uint64_data", 1),
    onnx.TensorProto.UINT64: ("uint64_data", 1),
    onnx.TensorProto.STRING: ("string_data", 1),
    onnx.TensorProto.COMPLEX64: ("float_data", 2),
    onnx.TensorProto.COMPLEX128: ("double_data", 2),
    **{
        t: ("int32_data", 1)
        for t in (
            onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
            onnx.TensorProto.UINT16, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL,
            onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
        )
    },
}




def validate_proto(proto: onnx.ModelProto, path: Path, root: Path) -> None:
    """Raise InputError on the first hostile or broken reference or structure in `proto`."""
    files: dict[str, tuple[str, int]] = {}  # location -> (real path, size), resolved once
    for tensor, where, sparse in stored_tensors(proto):
        _check_tensor(tensor, where, sparse, path, root, files)
    _, ordered = _check_graph(proto.graph, path, [], depth=0)
    _check_io_types(proto.graph, path)
    check_onnx(proto, path, ordered)


MIN_OPSET = 7  # onnxruntime only guarantees the default domain from opset 7 on
_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data",
                "uint64_data", "external_data", "data_location")


def check_onnx(proto: onnx.ModelProto, path: Path, ordered: bool) -> None:
    """onnx.checker's verdict on `proto` without its weights; refuses sparse initializers and old
    opsets. `ordered`: the main graph has no subgraph and lists each node after the producers of
    its inputs (`_check_graph`)."""
    if proto.graph.sparse_initializer:
        name = proto.graph.sparse_initializer[0].values.name
        raise InputError(f"{path}: sparse initializer '{name}' is not supported; store it dense")
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and not MIN_OPSET <= opset.version <= onnx.defs.onnx_opset_version():
            raise InputError(f"{path}: default-domain opset {opset.version} cannot be run by onnxruntime "
                             f"(supported: {MIN_OPSET}..{onnx.defs.onnx_opset_version()}); convert the model's opset")
    failed = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)
    if ordered:  # the nodes as listed: no need to sort them for the checker
        try:
            onnx.checker.check_model(_stripped(proto, kahn=False))
            return
        except failed:
            pass  # the verdict, and the node it names, as the nodes in Kahn's order give them
    try:
        onnx.checker.check_model(_stripped(proto, kahn=True))
    except failed as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        context = next((line.removeprefix("==> Context: ") for line in lines[1:] if line.startswith("==> Context")), "")
        raise InputError(f"{path}: invalid ONNX: {lines[0] if lines else type(exc).__name__}"
                         + (f" ({context})" if context else "")) from None


def _stripped(proto: onnx.ModelProto, kahn: bool) -> onnx.ModelProto:
    """A copy of `proto` whose main-graph initializers, and every external tensor, are placeholder
    scalars: no weight byte read or copied, no file opened by the checker (shapes, sizes and files
    are checked at load), and a value whose size fits what the checker wants. With `kahn`, its
    nodes in Kahn's order (the checker wants a topological one; onnxruntime and mtkc do not)."""
    copy = onnx.ModelProto()
    _copy_fields(proto, copy, skip={"graph"})
    _copy_fields(proto.graph, copy.graph, skip={"initializer"})
    for tensor in proto.graph.initializer:
        meta = copy.graph.initializer.add()
        meta.name, meta.data_type, meta.doc_string = tensor.name, tensor.data_type, tensor.doc_string
        _placeholder(meta)
    for tensor, _, _ in stored_tensors(copy):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            _placeholder(tensor)
    if kahn:
        _sort_nodes(copy.graph)
    for value in [*copy.graph.input, *copy.graph.output]:  # and a shape field (rank may be unknown)
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.SetInParent()
    _set_aside_unknown_ops(copy)
    imported = {o.domain for o in copy.opset_import} | {"", "ai.onnx"}
    for domain in sorted({n.domain for n in copy.graph.node} - imported):  # onnxruntime assumes one
        copy.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return copy


def _sort_nodes(graph: onnx.GraphProto) -> None:
    producer = {name: i for i, node in enumerate(graph.node) for name in node.output if name}
    successors: list[list[int]] = [[] for _ in graph.node]
    for j, node in enumerate(graph.node):
        reads = list(node.input)
        for attr in node.attribute:  # outer-scope names a subgraph reads are inputs of its node
            for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                reads += [x for n in g.node for x in n.input]
        for name in set(reads):
            if name in producer and producer[name] != j:
                successors[producer[name]].append(j)
    order = kahn_order(successors)
    if order != list(range(len(graph.node))) and len(order) == len(graph.node):
        nodes = [graph.node[i] for i in order]
        sorted_nodes = [type(n)() for n in nodes]
        for new, old in zip(sorted_nodes, nodes):
            new.CopyFrom(old)
        del graph.node[:]
        graph.node.extend(sorted_nodes)


UNCHECKED_DOMAIN = "mtkc.unchecked"


def _set_aside_unknown_ops(model: onnx.ModelProto) -> None:
    """Default-domain ops onnx has no schema for (onnxruntime's own, e.g. SimplifiedLayerNormalization)
    move to a domain the checker skips: whether such an op runs is the capability table's question."""
    stack = [model.graph]
    moved = False
    while stack:
        graph = stack.pop()
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
                node.domain = UNCHECKED_DOMAIN
                moved = True
            for attr in node.attribute:
                stack.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
    if moved:
        model.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))


def _placeholder(tensor: onnx.TensorProto) -> None:
    for name in _DATA_FIELDS + ("dims",):
        tensor.ClearField(name)
    if tensor.data_type == onnx.TensorProto.STRING:
        tensor.string_data.append(b"")
    else:
        tensor.raw_data = bytes(16)  # fits a scalar of any type


def _copy_fields(src, dst, skip: set[str]) -> None:
    """Copy every set field of message `src` into `dst` except `skip` (never touches skipped bytes)."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name in skip:
            continue
        if fd.is_repeated:
            if len(getattr(src, fd.name)):
                getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif fd.message_type is not None:
            if src.HasField(fd.name):
                getattr(dst, fd.name).CopyFrom(getattr(src, fd.name))
        elif src.HasField(fd.name):
            setattr(dst, fd.name, getattr(src, fd.name))


# ---------------------------------------------------------------------------- external data


def resolve_location(root: Path, location: str) -> tuple[str, os.stat_result]:
    """Real path and `lstat` of `location` under `root`, per the policy in the module docstring.

    Raises ExternalDataError; never stats a path outside the allowed trees.
    """
    parts = location_parts(location)
    root_real = os.path.realpath(root)
    allowed = allowed_trees(root_real)
    current, pending, hops, st = root_real, list(reversed(parts)), 0, None
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":  # only from a symlink target; `current` is symlink-free here
            current, st = os.path.dirname(current), None
            continue
        current = os.path.join(current, part)
        if root_real == current or root_real.startswith(current + os.sep):
            st = None  # a folder on the model folder's own real path: nothing to check
            continue
        if not any(current == t or current.startswith(t + os.sep) for t in allowed):
            raise ExternalDataError(f"external data '{location}' is a symlink leaving the model folder")
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            raise ExternalDataError(f"external data file '{location}' is missing") from None
        except OSError as exc:
            raise ExternalDataError(f"external data file '{location}' cannot be accessed ({exc.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise ExternalDataError(f"external data '{location}' has too many levels of symlinks")
            target = os.readlink(current)
            current = os.sep if os.path.isabs(target) else os.path.dirname(current)
            pending.extend(reversed(target.split(os.sep)))
        elif pending and not stat.S_ISDIR(st.st_mode):
            raise ExternalDataError(f"external data file '{location}' is missing")
    if st is None or not stat.S_ISREG(st.st_mode):
        raise ExternalDataError(f"external data '{location}' is not a regular file")
    if st.st_nlink > 1:
        raise ExternalDataError(
            f"external data file '{location}' has {st.st_nlink} hard links (it may alias a file outside the model folder)"
        )
    return current, st


def open_external(root: Path, location: str):
    """Open a validated external-data file for reading (binary), refusing a swap since validation."""
    real, st = resolve_location(root, location)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(real, flags)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or opened.st_nlink > 1:
        os.close(fd)
        raise ExternalDataError(f"external data file '{location}' changed while it was opened")
    return os.fdopen(fd, "rb")


def location_parts(location: str) -> list[str]:
    """Components of a relative location ('/' and '\\' both separate); refuses escapes."""
    if not location:
        raise ExternalDataError("external data has no location")
    if "\0" in location:
        raise ExternalDataError(f"external data location {location!r} contains a NUL byte")
    if location.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", location):
        raise ExternalDataError(f"external data location '{location}' is an absolute path")
    parts = [p for p in re.split(r"[/\\]", location) if p not in ("", ".")]
    if ".." in parts:
        raise ExternalDataError(f"external data location '{location}' escapes the model folder ('..')")
    if not parts or location.endswith(("/", "\\")):
        raise ExternalDataError(f"external data location '{location}' names no file")
    return parts


def allowed_trees(root_real: str) -> list[str]:
    """The model folder, plus `<repo>/blobs` when the folder is in `<repo>/snapshots/<rev>/`."""
    trees = [root_real]
    parts = Path(root_real).parts
    for i in range(len(parts) - 2, 0, -1):  # nearest `<repo>/snapshots/<rev>` above the folder
        if parts[i] == "snapshots":
            trees.append(os.path.join(*parts[:i], "blobs"))
            break
    return trees


def external_size(tensor: onnx.TensorProto) -> int:
    """Bytes a tensor's data occupies (dims already checked non-negative)."""
    count = 1
    for d in tensor.dims:
        count *= d
    if tensor.data_type in SUB_BYTE_BITS:
        return (count * SUB_BYTE_BITS[tensor.data_type] + 7) // 8
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        raise ExternalDataError(f"has data type {tensor.data_type} that cannot be stored externally") from None


def external_fields(tensor: onnx.TensorProto, warn: bool = False) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external tensor, validated as text."""
    info: dict[str, str] = {}
    unknown = []
    for entry in tensor.external_data:
        if entry.key in info:
            raise ExternalDataError(f"external data key '{entry.key}' is given twice")
        if entry.key == "basepath":
            raise ExternalDataError("external data key 'basepath' is not supported (onnxruntime refuses it)")
        if entry.key in KNOWN_KEYS:
            info[entry.key] = entry.value
        else:
            unknown.append(entry.key)
    if unknown and warn:
        shown = ", ".join(repr(k) for k in unknown[:10])
        log.warning("mtkc: warning: tensor '%s' has unknown external_data keys %s (ignored)", tensor.name, shown)
    numbers = {}
    for key in ("offset", "length"):
        text = info.get(key)
        if text is not None and not _DECIMAL.fullmatch(text):
            raise ExternalDataError(f"external data {key} {text!r} is not a non-negative integer")
        numbers[key] = None if text is None else int(text)
    return info.get("location", ""), numbers["offset"] or 0, numbers["length"]


def _check_tensor(tensor: onnx.TensorProto, where: str, sparse: bool, path: Path, root: Path, files: dict) -> None:
    try:
        if sparse and tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ExternalDataError("external data in sparse tensors is not supported")
        if any(d < 0 for d in tensor.dims):
            raise ExternalDataError(f"has a negative dimension {list(tensor.dims)}")
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            _check_external(tensor, root, files)
        else:
            _check_inline(tensor)
    except ExternalDataError as exc:
        raise InputError(f"{path}: {where}: {exc}") from None


def _check_external(tensor: onnx.TensorProto, root: Path, files: dict) -> None:
    if tensor.data_type == onnx.TensorProto.STRING:
        raise ExternalDataError("string tensors cannot have external data")
    size = external_size(tensor)
    location, offset, length = external_fields(tensor, warn=True)
    if location not in files:
        real, st = resolve_location(root, location)
        files[location] = (real, st.st_size)
    file_size = files[location][1]
    if length is not None and length != size:
        raise ExternalDataError(f"external data length {length} does not match its shape ({size} bytes)")
    if offset + size > file_size:
        raise ExternalDataError(
            f"external data offset {offset} + length {size} exceeds the size of '{location}' ({file_size} bytes)"
        )


def _check_inline(tensor: onnx.TensorProto) -> None:
    if tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
        size = external_size(tensor)
        if len(tensor.raw_data) != size:
            raise ExternalDataError(f"has {len(tensor.raw_data)} bytes of raw_data, its shape needs {size}")
        return
    field, per = _TYPED_FIELD.get(tensor.data_type, (None, 0))
    if field is None:
        return
    count = 1
    for d in tensor.dims:
        count *= d
    have = len(getattr(tensor, field))
    if have != count * per:
        raise ExternalDataError(f"has {have} values in {field}, its shape needs {count * per}")


def stored_tensors(proto: onnx.ModelProto):
    """(TensorProto, description, is part of a sparse tensor) for every tensor stored in the model, subgraphs included."""
    yield from _graph_tensors(proto.graph)
    for func in proto.functions:
        yield from _node_tensors(func.node, f"function '{func.name}' ")


def _graph_tensors(graph: onnx.GraphProto):
    for t in graph.initializer:
        yield t, f"tensor '{t.name}'", False
    for s in graph.sparse_initializer:
        yield from _sparse_parts(s, f"sparse tensor '{s.values.name}'")
    yield from _node_tensors(graph.node, "")


def _node_tensors(nodes, prefix: str):
    for node in nodes:
        label = f"{prefix}node '{node.name}' ({node.op_type})"
        for attr in node.attribute:
            where = f"{label} attribute '{attr.name}'"
            if attr.type in _TENSOR_ATTRS:
                for t in [attr.t] if attr.type == onnx.AttributeProto.TENSOR else attr.tensors:
                    yield t, f"{where} tensor '{t.name}'", False
            elif attr.type in _SPARSE_ATTRS:
                for s in [attr.sparse_tensor] if attr.type == onnx.AttributeProto.SPARSE_TENSOR else attr.sparse_tensors:
                    yield from _sparse_parts(s, f"{where} sparse tensor '{s.values.name}'")
            elif attr.type in _GRAPH_ATTRS:
                for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                    yield from _graph_tensors(g)


def _sparse_parts(sparse: onnx.SparseTensorProto, where: str):
    for part in (sparse.values, sparse.indices):
        yield part, where, True


# ---------------------------------------------------------------------------- structure


def _check_io_types(graph: onnx.GraphProto, path: Path) -> None:
    """A main-graph input or output typed as a tensor of UNDEFINED elements (an explicit 0, which
    the checker lets through): onnxruntime refuses it, and symbolic shape inference cycles on it."""
    for kind, values in (("input", graph.input), ("output", graph.output)):
        for v in values:
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED:
                raise InputError(f"{path}: graph {kind} '{v.name}' has element type UNDEFINED (0)")


def _check_graph(graph: onnx.GraphProto, path: Path, outer: list[set[str]], depth: int) -> tuple[set[str], bool]:
    """Check one (sub)graph; returns the names it reads from enclosing scopes, and whether it has no
    subgraph and lists each node after the producers of its inputs."""
    if depth > MAX_SUBGRAPH_DEPTH:
        raise InputError(f"{path}: graph '{graph.name}' is nested more than {MAX_SUBGRAPH_DEPTH} subgraphs deep")
    defined = {v.name for v in graph.input}
    defined.update(t.name for t in graph.initializer)
    defined.update(s.values.name for s in graph.sparse_initializer)
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.output:
            if not name:
                continue
            if name in producer or name in defined:
                other = graph.node[producer[name]] if name in producer else None
                by = f"node {_node(other)}" if other is not None else "a graph input or initializer"
                raise InputError(f"{path}: node {_node(node)} output '{name}' is already produced by {by}")
            producer[name] = i
    scopes = [*outer, defined, producer.keys()]
    free: set[str] = set()
    reads: list[list[str]] = []
    plain = True
    for node in graph.node:
        names = [n for n in node.input if n]
        for attr in node.attribute:
            if attr.type in _GRAPH_ATTRS:
                plain = False
                for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                    names.extend(sorted(_check_graph(g, path, scopes, depth + 1)[0]))
        for name in names:
            if name in producer or name in defined:
                continue
            if any(name in s for s in outer):
                free.add(name)
                continue
            raise InputError(
                f"{path}: node {_node(node)} input '{name}' is not produced by any node, graph input or initializer"
            )
        reads.append(names)
    for out in graph.output:
        if out.name not in producer and out.name not in defined and not any(out.name in s for s in outer):
            raise InputError(f"{path}: graph output '{out.name}' is not produced by any node, graph input or initializer")
    return free, _check_acyclic(graph, path, producer, reads) and plain


def _check_acyclic(graph: onnx.GraphProto, path: Path, producer: dict[str, int], reads: list[list[str]]) -> bool:
    """Names one node of a cycle if there is one; returns whether each node comes after the
    producers of what it reads (then there is none)."""
    if all(producer.get(x, -1) < i for i, names in enumerate(reads) for x in names):
        return True
    consumers: list[list[int]] = [[] for _ in graph.node]
    for i, names in enumerate(reads):
        for x in names:
            if x in producer:
                consumers[producer[x]].append(i)
    i = cycle_node(consumers)
    if i is not None:
        raise InputError(f"{path}: node {_node(graph.node[i])} is part of a cycle")
    return False


def _node(node: onnx.NodeProto) -> str:
    return f"'{node.name}' ({node.op_type})" if node.name else f"<unnamed {node.op_type} -> {list(node.output)}>"
