"""`mtkc check` as an API: bind dynamic dims, type every tensor, judge every node against a table.

    check(model, sdk, ...) -> CheckReport       (what `mtkc check` prints)
    assess(graph, table, ...) -> Assessment     (coverage/partitions/unsupported of any graph)

Nothing is written and no weight is read (only small integer constants that shape inference
needs). `CheckReport.coverage_compiled` stays None until the pass manager fills it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc import capability, shapes
from mtkc.capability import Table, Verdict
from mtkc.errors import InputError

log = logging.getLogger("mtkc")

SCHEMA_VERSION = 1

# Symbolic dim names exporters use for the three roles (torch dynamic_axes, optimum, ORT tools).
_NAMED = {
    "batch": "batch", "batch_size": "batch",
    "seq": "seq", "seq_len": "seq", "sequence_length": "seq", "sequence": "seq",
    "past_seq_len": "cache", "past_sequence_length": "cache", "past_len": "cache", "cache_length": "cache",
    "total_seq_len": "total", "total_sequence_length": "total", "all_seq_len": "total",
}
_PAST = re.compile(r"^past|cache", re.IGNORECASE)  # past_key_values.0.key, input.cache.layers.0.keys, k_cache_0


@dataclass
class Group:
    """Unsupported nodes sharing op, domain and reason (detail/remedy of the first one)."""

    op: str
    domain: str
    verdict: Verdict  # of the first node
    nodes: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return self.verdict.reason

    @property
    def count(self) -> int:
        return len(self.nodes)

    def to_json(self) -> dict:
        v = self.verdict
        return {"op": self.op, "domain": self.domain, "count": self.count, "reason": v.reason,
                "detail": v.detail, "remedy": v.remedy, "nodes": list(self.nodes)}


@dataclass
class Assessment:
    nodes: int  # non-Constant nodes judged
    supported: int
    partition_sizes: list[int]  # maximal runs of NPU nodes in topological order
    groups: list[Group]
    constants: int = 0  # Constant nodes (data, not judged)

    @property
    def coverage(self) -> float:
        return round(self.supported / self.nodes, 4) if self.nodes else 1.0

    @property
    def partitions(self) -> int:
        return len(self.partition_sizes)


@dataclass
class CheckReport:
    sdk: str
    arch: str
    model: str
    assessment: Assessment
    unbound: list[str] = field(default_factory=list)  # symbolic dims no option bound
    coverage_compiled: float | None = None

    @property
    def verdict(self) -> str:
        """ORT usability-checker thresholds on the largest NPU partition."""
        a = self.assessment
        if not a.nodes or a.supported == a.nodes:
            return "GOOD"
        largest = max(a.partition_sizes, default=0) / a.nodes
        return "GOOD" if largest > 0.75 else "MAYBE" if largest > 0.5 else "POOR"

    def to_json(self) -> dict:
        a = self.assessment
        return {
            "schema_version": SCHEMA_VERSION,
            "sdk": self.sdk,
            "arch": self.arch,
            "model": self.model,
            "nodes": a.nodes,
            "coverage": {"raw": a.coverage, "compiled": self.coverage_compiled},
            "partitions": a.partitions,
            "unsupported": [g.to_json() for g in a.groups],
        }


def check(model_path, sdk: str, arch: str | None = None, seq_len: int | None = None,
          cache_len: int | None = None, batch: int | None = None,
          input_shapes: dict[str, tuple[int, ...]] | None = None) -> CheckReport:
    """Judge every node of the model at `model_path` for NeuroPilot `sdk`."""
    from mtkc.model import load

    table = capability.load_table(sdk, arch)  # unknown SDK fails before the model is read
    model = load(model_path)
    unbound = bind_dims(model.graph, seq_len, cache_len, batch, input_shapes or {})
    annotate_shapes(model.graph, model.root)
    assessment = assess(model.graph, table, model.opset, model.values)
    return CheckReport(sdk=table.version, arch=table.arch, model=str(model_path),
                       assessment=assessment, unbound=unbound)


def assess(graph: gs.Graph, table: Table, opset: int | None = None,
           read_values: Callable[[gs.Constant], np.ndarray] | None = None) -> Assessment:
    """Verdicts for every node of a typed graph, grouped; partitions estimated (linear)."""
    try:
        graph.toposort()
    except Exception as exc:  # graphsurgeon raises a bare Exception on cycles
        raise InputError(f"graph '{graph.name}' is not a DAG ({exc})") from None
    groups: dict[tuple[str, str, str], Group] = {}
    sizes: list[int] = []
    run = supported = constants = 0
    for node in graph.nodes:
        if node.op == "Constant":
            constants += 1
            continue
        v: Verdict = table.verdict(node, opset, read_values)
        if v.supported:
            supported += 1
            run += 1
            continue
        if run:
            sizes.append(run)
            run = 0
        domain = node.domain or capability.DEFAULT_DOMAIN
        key = (node.op, domain, v.reason)
        if key not in groups:
            groups[key] = Group(node.op, domain, v)
        groups[key].nodes.append(node.name)
    if run:
        sizes.append(run)
    ordered = sorted(groups.values(), key=lambda g: (-g.count, g.domain, g.op, g.reason))
    return Assessment(len(graph.nodes) - constants, supported, sizes, ordered, constants)


# ---- shape binding -------------------------------------------------------------------------------


def bind_dims(graph: gs.Graph, seq_len: int | None, cache_len: int | None, batch: int | None,
              input_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Replace symbolic dims by the values the options give, on every tensor; return the rest.

    A symbol is bound by its name (sequence_length, past_sequence_length, batch_size, ...), by
    where it sits (input_ids dim 1 = seq, past_* dim 2 = cache, attention_mask dim 1 = cache+seq,
    dynamo's s0-style names), or by `--input-shape`. Sums like 'past_sequence_length +
    sequence_length' are evaluated. Batch defaults to 1 once any other dim is bound.
    """
    inputs = {t.name: t for t in graph.inputs}
    for name, shape in input_shapes.items():
        if name not in inputs:
            raise InputError(f"--input-shape: graph has no input '{name}'; inputs: {', '.join(inputs)}")
        if inputs[name].shape is not None and len(inputs[name].shape) != len(shape):
            raise InputError(f"--input-shape {name}: rank {len(shape)} given, the input has rank "
                             f"{len(inputs[name].shape)}")
    has_past = any(_PAST.search(n) for n in inputs)
    if batch is None and (seq_len is not None or cache_len is not None or input_shapes):
        batch = 1
    total = seq_len + (cache_len or 0) if seq_len is not None and (cache_len is not None or not has_past) else None
    roles = {"batch": batch, "seq": seq_len, "cache": cache_len if has_past else None, "total": total}

    symbols: dict[str, int] = {}
    for name, shape in input_shapes.items():  # explicit shapes win
        for dim, value in zip(inputs[name].shape or (), shape):
            if _is_symbol(dim):
                symbols.setdefault(dim, value)
    for name, t in inputs.items():
        for axis, role in _roles(name, t.shape, has_past).items():
            dim = t.shape[axis]
            if _is_symbol(dim) and roles[role] is not None:
                symbols.setdefault(dim, roles[role])
    for sym, role in _NAMED.items():
        if roles[role] is not None:
            symbols.setdefault(sym, roles[role])

    for name, shape in input_shapes.items():
        inputs[name].shape = list(shape)
    unbound: set[str] = set()
    for t in graph.tensors().values():
        if isinstance(t, gs.Variable) and t.shape is not None and t.name not in input_shapes:
            t.shape = [_resolve(d, symbols) for d in t.shape]
            if t in graph.inputs:
                unbound.update(d for d in t.shape if isinstance(d, str))
    return sorted(unbound)


def _roles(name: str, shape, has_past: bool) -> dict[int, str]:
    """Which role each axis of a well-known graph input plays."""
    if shape is None:
        return {}
    rank = len(shape)
    if name in ("input_ids", "inputs_embeds", "hidden_states", "position_ids") and rank >= 2:
        return {0: "batch", 1: "seq"}
    if _PAST.search(name) and rank == 4:
        return {0: "batch", 2: "cache"}
    if name == "attention_mask":
        if rank == 2:
            return {0: "batch", 1: "total" if has_past else "seq"}
        if rank == 4:
            return {0: "batch", 2: "seq", 3: "total"}
    return {}


def _is_symbol(dim) -> bool:
    return isinstance(dim, str) and dim.strip() != "" and not dim.strip().isdigit() and "+" not in dim


def _resolve(dim, symbols: dict[str, int]):
    """An int when the dim is an int, a numeric string, a bound symbol or a sum of those."""
    if not isinstance(dim, str):
        return dim
    total = 0
    for term in dim.split("+"):
        term = term.strip()
        if term.isdigit():
            total += int(term)
        elif term in symbols:
            total += symbols[term]
        else:
            return dim
    return total


# ---- shape inference -----------------------------------------------------------------------------


def annotate_shapes(graph: gs.Graph, root: Path | None = None) -> None:
    """Type every tensor: ONNX inference (`mtkc.shapes.infer`, weight-stripped), then, when the
    graph inputs are fully bound but some tensor is still dynamic, onnxruntime's symbolic shape
    inference, which follows the Shape/Gather/Concat/Expand chains of TorchScript exports that
    ONNX data propagation gives up on (and knows com.microsoft ops)."""
    shapes.infer(graph, root)
    if not all(_static(t) for t in graph.inputs) or all(_static(t) for t in graph.tensors().values()):
        return
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(shapes.stripped_proto(graph, root), auto_merge=True)
    except Exception as exc:  # it raises bare Exceptions on ops it cannot handle
        log.debug("symbolic shape inference failed: %s", exc)
        return
    tensors = graph.tensors()
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        t = tensors.get(vi.name)
        if isinstance(t, gs.Variable) and not _static(t) and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape.dim
            if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                t.shape = [d.dim_value for d in dims]
                t.dtype = t.dtype or onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)


def _static(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant) or (t.shape is not None and all(isinstance(d, int) for d in t.shape))
