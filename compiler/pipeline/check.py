"""`mtkc check` as an API: bind dynamic dims, type every tensor, judge every node against a table.

    check(model, sdk, ...) -> CheckReport       (what `mtkc check` prints)
    assess(graph, table, ...) -> Assessment     (coverage/partitions/unsupported of any graph)

Nothing is written and no weight is read (only small constants that shape inference needs).
`check` also runs the pass pipeline (default, or as `pipeline` options select it) in memory for
the coverage after passes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.errors import InputError
from mtkc.ir import shapes
from mtkc.ir.graph_utils import toposort
from mtkc.ir.model import Model
from mtkc.rewrite.pass_api import Context
from mtkc.target import capability
from mtkc.target.capability import Table, Verdict

log = logging.getLogger("mtkc")

SCHEMA_VERSION = 1


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
    rewritten_by: dict[str, str] = field(default_factory=dict)  # unsupported node -> pass that fixes it
    quantization: dict = field(default_factory=dict)  # mtkc.passes.qdq.quantization_state of the input

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
            "unsupported": [
                {**g.to_json(), "rewritten_by": {n: self.rewritten_by[n] for n in g.nodes if n in self.rewritten_by}}
                for g in a.groups
            ],
            "quantization": self.quantization,
        }


def check(model_path, sdk: str, arch: str | None = None, seq_len: int | None = None,
          cache_len: int | None = None, batch: int | None = None,
          input_shapes: dict[str, tuple[int, ...]] | None = None, compiled: bool = True,
          pipeline: dict | None = None) -> CheckReport:
    """Judge every node of the model at `model_path` for NeuroPilot `sdk`.

    `compiled`: also run the pass pipeline in memory (`mtkc.pipeline.compile.compiled_coverage`)
    for the coverage after passes and, per unsupported node, the pass that rewrites it.
    `pipeline`: compile's pipeline options (`passes`, `skip_passes`, `plugins`, pass options);
    plugins and pass names are checked before the model is read (PassError/InputError).
    """
    from mtkc.ir.model import load
    from mtkc.manager.pass_manager import load_registry

    table = capability.load_table(sdk, arch)  # unknown SDK fails before the model is read
    pipeline = dict(pipeline or {})
    if compiled:
        registry = load_registry(pipeline.get("plugins") or ())
        for name in [*(pipeline.get("passes") or []), *(pipeline.get("skip_passes") or [])]:
            registry.get(name)
    options = {**pipeline, "seq_len": seq_len, "cache_len": cache_len, "batch": batch, "input_shapes": input_shapes}
    report = check_model(load(model_path), table, options, compiled)
    report.model = str(model_path)
    return report


def check_model(model: Model, table: Table, options: dict, compiled: bool = True) -> CheckReport:
    """`check` of a loaded model: binds and types `model.graph` in place; the pipeline (when
    `compiled`) runs on `model.fresh()`, so the file is parsed once."""
    unbound = bind_and_type(model.graph, Context(table, options, model.root))
    assessment = assess(model.graph, table, model.opset, model.values)
    from mtkc.passes.qdq import quantization_state

    report = CheckReport(sdk=table.version, arch=table.arch, model=str(model.path),
                         assessment=assessment, unbound=unbound, quantization=quantization_state(model.graph))
    if compiled:
        from mtkc.errors import MtkcError
        from mtkc.pipeline.compile import compiled_coverage

        try:
            watch = [n for g in assessment.groups for n in g.nodes]
            report.coverage_compiled, report.rewritten_by = compiled_coverage(model.fresh(), table, options, watch)
        except MtkcError as exc:  # check still reports the raw verdicts
            log.warning("mtkc: coverage after passes unavailable: %s", exc)
    return report


def assess(graph: gs.Graph, table: Table, opset: int | None = None,
           read_values: Callable[[gs.Constant], np.ndarray] | None = None) -> Assessment:
    """Verdicts for every node of a typed graph, grouped; partitions estimated (linear)."""
    try:
        toposort(graph)
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


# ---- shape inference -----------------------------------------------------------------------------


def bind_and_type(graph: gs.Graph, ctx: Context) -> list[str]:
    """Bind dims (the bind-shapes pass, which also infers), type every tensor, return the input
    dims still symbolic (each one leaves its consumers `shape-dynamic`)."""
    from mtkc.passes.bind_shapes import BindShapes

    bind = BindShapes()
    if bind.applies(ctx):
        bind.run(graph, ctx)
    else:
        shapes.infer(graph, ctx.root)  # with onnxruntime's symbolic fallback
    return sorted({d for t in graph.inputs for d in t.shape or () if isinstance(d, str) and not d.isdigit()})
