"""`mtkc check` as an API: what compile will do with a model for one SDK, then the input's own verdicts.

    check(model, sdk, options) -> CheckReport

Leads with compile's outcome (`mtkc.pipeline.build`: the same defaults, choices, graphs, pipeline
and partitions compile uses): verdict, partitions, largest NPU partition, whether `--strict`
passes. Second, the raw verdicts of the input (dims bound as the user bound them), grouped by
op and reason, each with the pass that rewrote it in compile's pipeline. Nothing is written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap, decoder_map
from mtkc.errors import MtkcError
from mtkc.ir.model import Model, load
from mtkc.pipeline.registry import load_registry
from mtkc.options import Options, of
from mtkc.passes.qdq import quantization_state
from mtkc.pipeline.build import Build, Placement, build, plan_graphs, raw_assessment
from mtkc.pipeline.worker import Worker, wanted
from mtkc.rewrite.pass_api import Pass
from mtkc.target import capability
from mtkc.target.assess import Assessment, Group

log = logging.getLogger("mtkc")

SCHEMA_VERSION = 2
SHAPE_REMEDY = "--seq-len, --cache-len, --batch or --input-shape (compile binds T=128, C=512, batch 1)"


@dataclass
class GraphSummary:
    """One graph compile writes: its nodes and NPU/CPU partitions."""

    name: str
    nodes: int
    cpu_nodes: int
    partitions: int
    npu_partitions: int
    largest_npu: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CheckReport:
    sdk: str
    arch: str
    model: str
    assessment: Assessment  # the input's verdicts
    unbound: list[str] = field(default_factory=list)  # input dims the user's options left symbolic
    graphs: list[GraphSummary] = field(default_factory=list)  # what compile writes (empty: not compiled)
    coverage_compiled: float | None = None
    bound: dict[str, int] = field(default_factory=dict)  # dims compile binds by default
    picked: dict[str, str] = field(default_factory=dict)  # choices compile makes, with why
    suggested: dict[str, str] = field(default_factory=dict)  # your choices that place worse, and the better value
    on_cpu: list[dict] = field(default_factory=list)  # {graph, node, reason} left on the CPU by compile
    rewritten_by: dict[str, str] = field(default_factory=dict)  # unsupported node -> pass that fixes it
    quantization: dict = field(default_factory=dict)  # mtkc.passes.qdq.quantization_state of the input
    decoder: DecoderMap | None = None  # the input's decoder layers, found by structure

    @property
    def cpu_fallback(self) -> bool:
        """Some node runs on the CPU (what `--strict` refuses): after compile, else in the input."""
        if self.graphs:
            return any(g.cpu_nodes for g in self.graphs)
        return self.assessment.supported < self.assessment.nodes

    @property
    def partitions(self) -> int:
        return sum(g.partitions for g in self.graphs) if self.graphs else self.assessment.partitions

    @property
    def largest_partition(self) -> int:
        """Nodes in the largest NPU partition (of the graph where it is smallest)."""
        if self.graphs:
            return min(g.largest_npu for g in self.graphs)
        return max(self.assessment.partition_sizes, default=0)

    @property
    def verdict(self) -> str:
        """ORT usability-checker thresholds on the largest NPU partition, worst graph first."""
        return min((_verdict(g.largest_npu, g.nodes, g.cpu_nodes) for g in self.graphs), key=VERDICTS.index) \
            if self.graphs else _verdict(self.largest_partition, self.assessment.nodes,
                                         self.assessment.nodes - self.assessment.supported)

    def remedy(self, group: Group) -> str:
        """One style: the pass that fixes the group's nodes in compile (or the table's passes), the
        option, or the first SDK that runs them; else `CPU fallback`. The table's hint is `hint`."""
        fixed = {self.rewritten_by[n] for n in group.nodes if n in self.rewritten_by}
        if group.reason == "shape-dynamic":
            return SHAPE_REMEDY
        if fixed and len(fixed) == 1 and all(n in self.rewritten_by for n in group.nodes):
            return f"pass {fixed.pop()} (compile runs it)"
        v = group.verdict
        known = v.known_passes
        if v.passes:
            return ", ".join(f"pass {p}" + (" (planned)" if known is not None and p not in known else "") for p in v.passes)
        return f"--sdk {v.first_sdk}" if v.first_sdk else "CPU fallback"

    def to_json(self) -> dict:
        a = self.assessment
        return {
            "schema_version": SCHEMA_VERSION,
            "sdk": self.sdk,
            "arch": self.arch,
            "model": self.model,
            "verdict": self.verdict,
            "strict": "fail" if self.cpu_fallback else "pass",
            "partitions": self.partitions,
            "largest_partition": self.largest_partition,
            "graphs": [g.to_json() for g in self.graphs],
            "unbound": list(self.unbound),
            "bound": dict(self.bound),
            "picked": dict(self.picked),
            "suggested": dict(self.suggested),
            "on_cpu": list(self.on_cpu),
            "nodes": a.nodes,
            "coverage": {"raw": a.coverage, "compiled": self.coverage_compiled},
            "unsupported": [
                {"op": g.op, "domain": g.domain, "count": g.count, "reason": g.reason, "detail": g.verdict.detail,
                 "remedy": self.remedy(g), "hint": g.verdict.hint, "nodes": list(g.nodes),
                 "rewritten_by": {n: self.rewritten_by[n] for n in g.nodes if n in self.rewritten_by}}
                for g in a.groups
            ],
            "quantization": self.quantization,
            "decoder": self.decoder.to_json() if self.decoder is not None else None,
        }


VERDICTS = ("POOR", "MAYBE", "GOOD")


def _verdict(largest: int, nodes: int, cpu_nodes: int) -> str:
    if not nodes or not cpu_nodes:
        return "GOOD"
    share = largest / nodes
    return "GOOD" if share > 0.75 else "MAYBE" if share > 0.5 else "POOR"


def check(model_path, sdk: str, options: Options | dict[str, Any] | None = None, compiled: bool = True,
          jobs: int | None = None, **values: Any) -> CheckReport:
    """Judge the model at `model_path` for NeuroPilot `sdk` (see the module docstring).

    `options`: compile's options (typed, or a dict validated like the CLI's); keyword `values`
    are added to them (`check(m, "8.0", seq_len=8)`). `compiled=False`: only the raw verdicts.
    `jobs`: 1: everything in this process; 2: the raw verdicts and the graphs after the first in
    forked children (`mtkc.pipeline.worker`); None: 2 for a big graph on a machine with 2 CPUs.
    Same report either way.
    Plugins and pass names are checked before the model is read.
    """
    options = of(options)
    if values:
        extra = of(values)  # validated like any other source
        options = options.replace(**{key: getattr(extra, key) for key in values})
    table = capability.load_table(sdk, options.arch)  # unknown SDK fails before the model is read
    if compiled:
        registry = load_registry(options.plugins)
        for name in [*(options.passes or []), *options.skip_passes]:
            registry.get(name)
    model = load(model_path)
    decoder = decoder_map(model.graph)
    if not compiled:
        raw, unbound = raw_assessment(model, table, options)
        return CheckReport(table.version, table.arch, str(model_path), raw, unbound,
                           quantization=quantization_state(model.graph), decoder=decoder)
    worker = later = None
    try:
        if wanted(model, jobs):  # forked before any pass touches the graph
            worker = Worker.raw(model, table, options)
            later = _later(model, options, table, decoder)
        raw = _Raw(model, table, options, worker)
        fixed: dict[str, str] = {}
        first = True  # the first pass's graph is judged whatever it did: the input's verdicts had dims bound

        def track(p: Pass, graph: gs.Graph, touched: bool) -> None:
            nonlocal first
            pending = raw.watch.difference(fixed)
            if not pending or not (first or touched):  # all fixed, or the verdicts stand as after the pass before
                return
            first = False
            nodes = {n.name: n for n in graph.nodes}
            for name in sorted(pending):
                node = nodes.get(name)
                if node is None or table.supports(node, graph.opset, model.values):
                    fixed[name] = p.name

        ahead = later and _RawFirst(raw, later)
        try:
            result = build(model, options, table, observe=track, raw=False, suggest=True, decoder=decoder, ahead=ahead)
        except MtkcError as exc:  # the raw verdicts still stand; say why compile's outcome is missing
            report = raw.report(model_path, decoder)
            log.warning("mtkc: compile would stop: %s; the verdict below is the input's", exc)
            return report
        report = raw.report(model_path, decoder)
    finally:
        for child in (worker, later):
            if child is not None:
                child.close()
    _add_build(report, result)
    watched = {n for g in report.assessment.groups for n in g.nodes}
    report.rewritten_by = {name: p for name, p in fixed.items() if name in watched}
    return report


class _Raw:
    """The input's raw verdicts: made here before the build, or by a child (`Worker.raw`) and taken
    when first needed. `watch`: the names whose fixing pass check tracks, the verdicts' own when
    made here, else every judged node's (a superset: the same passes are found for the names that
    count)."""

    def __init__(self, model: Model, table, options: Options, worker: Worker | None):
        self.model, self.table, self.options, self.worker = model, table, options, worker
        self.found: tuple[Assessment, list[str], dict] | None = None
        if worker is None:
            self.found = self._here(model.copy())
            self.watch = {n for g in self.found[0].groups for n in g.nodes}
        else:
            self.watch = {n.name for n in model.graph.nodes if n.op != "Constant"}  # `assess` judges no Constant

    def take(self) -> tuple[Assessment, list[str], dict]:
        """The verdicts, unbound dims and quantization state; the child's error raised (once its
        records are replayed). When the child gave no answer, made here on a fresh import."""
        if self.found is None:
            self.found = self.worker.raw_answer() or self._here(self.model.fresh())
        return self.found

    def report(self, model_path, decoder: DecoderMap) -> CheckReport:
        raw, unbound, quantization = self.take()
        return CheckReport(self.table.version, self.table.arch, str(model_path), raw, unbound,
                           quantization=quantization, decoder=decoder)

    def _here(self, model: Model) -> tuple[Assessment, list[str], dict]:
        raw, unbound = raw_assessment(model, self.table, self.options)
        return raw, unbound, quantization_state(model.graph)


class _RawFirst:
    """`build`'s `ahead`: the raw verdicts are taken (a failing input's error raised) before the
    later graphs' placements and their records, in the order check made them in one process."""

    def __init__(self, raw: _Raw, later: Worker):
        self.raw, self.later = raw, later

    def collect(self, rope_mode: str | None) -> list[Placement] | None:
        self.raw.take()
        return self.later.collect(rope_mode)


def _later(model: Model, options: Options, table, decoder: DecoderMap) -> Worker | None:
    """A child building compile's graphs after the first (`Worker.later`), forked before the
    first's passes; None when there are none, a pass is not built in, or planning fails (`build`
    then fails the same way, reported as compile's outcome)."""
    try:
        _, planned, (_, *rest) = plan_graphs(model.graph, options, decoder)
    except MtkcError:
        return None
    return Worker.later(model, planned, rest, table)


def _add_build(report: CheckReport, result: Build) -> None:
    for v in result.variants:
        nodes = sum(len(p["nodes"]) for p in v.partitions)
        npu = [p for p in v.partitions if p["target"] == "npu"]
        report.graphs.append(GraphSummary(v.name, nodes, v.cpu_nodes, len(v.partitions), len(npu), v.largest_npu))
        report.on_cpu += [{"graph": v.name, "node": node, "reason": reason}
                          for p in v.partitions for node, reason in p.get("cpu_reasons", {}).items()]
    known = [v.coverage for v in result.variants if v.coverage is not None]
    report.coverage_compiled = min(known) if known else None
    report.bound = dict(result.bound)
    report.picked = dict(result.picked)
    report.suggested = dict(result.suggested)
