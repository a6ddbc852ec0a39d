"""Compile in memory: what `mtkc compile` writes and what `mtkc check` reports, from one function.

    build(model, options, table) -> Build
        raw verdicts (the input, dims bound as the user bound them)
        ─► defaults: dims left unbound get MediaTek's LLM convention (T = 128, C = 512, batch 1),
            unless the user's pipeline leaves out bind-shapes
        ─► plan the graphs (`model`, or prefill/decode per chunk)
        ─► per graph: a copy of the input's graph ─► pass pipeline (once) ─► NPU/CPU partitions
        ─► choices the user left open (rope_mode) are made by the passes on the first graph, from
           what they know (the cos/sin table size against the SDK's Gather limit), and kept for the rest

Nothing is written; weights are read only where a pass needs their values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import DecoderMap, decoder_map
from mtkc.backend.stitch import Split, split
from mtkc.display import Progress, escape
from mtkc.errors import InputError
from mtkc.ir import shapes
from mtkc.ir.counts import count
from mtkc.ir.model import Model
from mtkc.manager.pass_manager import PassRecord, Pipeline, resolve_pipeline, run_pipeline
from mtkc.pipeline.registry import load_registry
from mtkc.options import Options
from mtkc.passes.bind_shapes import BindShapes, has_past, roles_of
from mtkc.passes.kv_cache import variants as plan_variants
from mtkc.rewrite.pass_api import Context, Pass
from mtkc.target.assess import Assessment, assess
from mtkc.target.capability import Table

log = logging.getLogger("mtkc")

LLM_DEFAULTS = {"seq_len": 128, "cache_len": 512, "batch": 1}  # MediaTek's LLM convention (prefill T, cache C)


@dataclass
class Compiled:
    """One pipeline run on one graph (in place)."""

    model: Model
    ctx: Context
    pipeline: Pipeline
    records: list[PassRecord]
    coverage: float | None  # after the passes (None: the table gives no verdicts, e.g. a stand-in)


@dataclass
class Placement:
    """Where one graph's nodes run (`model`, or `prefill`/`decode`): what `check` reports of it."""

    name: str
    partitions: list[dict]  # the manifest's partition entries
    coverage: float | None  # after the passes (None: the table gives no verdicts, e.g. a stand-in)

    @property
    def cpu_nodes(self) -> int:
        return sum(len(p["nodes"]) for p in self.partitions if p["target"] != "npu")

    @property
    def largest_npu(self) -> int:
        return max((len(p["nodes"]) for p in self.partitions if p["target"] == "npu"), default=0)


@dataclass
class GraphVariant(Placement):
    """One graph to write, its pipeline run and its partitions."""

    graph: gs.Graph
    compiled: Compiled
    split: Split


class Ahead(Protocol):
    """The graphs after the first, built elsewhere: their placements once the first graph chose its
    rope mode, or None when this process must build them."""

    def collect(self, rope_mode: str | None) -> list[Placement] | None: ...


@dataclass
class Build:
    options: Options  # as used: defaults bound, choices picked
    variants: list[Placement]  # GraphVariants, but for graphs built elsewhere (`Ahead`)
    raw: Assessment | None = None  # the input's verdicts (None for a stand-in table)
    unbound: list[str] = field(default_factory=list)  # input dims the user's options left symbolic
    bound: dict[str, int] = field(default_factory=dict)  # options set to LLM_DEFAULTS
    picked: dict[str, str] = field(default_factory=dict)  # choice -> "value: why"
    suggested: dict[str, str] = field(default_factory=dict)  # a choice the user made that places worse
    decoder: DecoderMap | None = None  # the input's decoder layers (`mtkc.analysis.decoder`)


def build(model: Model, options: Options, table, observe: Callable[[Pass, gs.Graph, bool], None] | None = None,
          raw: bool = True, suggest: bool = False, decoder: DecoderMap | None = None,
          ahead: Ahead | None = None, built: Callable[[GraphVariant], None] | None = None) -> Build:
    """Everything compile decides for `model` (its graph is the first variant's, rewritten in place).

    `observe(pass, graph, touched)` runs after every pass of the first graph (`run_pipeline`). `suggest`:
    also try the other value of a choice the user made, and say when it places better (`check`).
    `decoder`: the input's DecoderMap, when the caller has it. `ahead`: the graphs after the first,
    built meanwhile elsewhere (their placements only: `check`'s `mtkc.pipeline.worker`). `built(variant)`
    runs on each graph this process builds, in order, as soon as it is built (compile writes it while
    the next one builds); with it, the input's verdicts are taken after the first graph, not before.
    """
    result = Build(options, [], decoder=decoder or decoder_map(model.graph))
    given, assess, writes = options, raw and isinstance(table, Table), built is not None and ahead is None
    if assess and not writes:
        result.raw, result.unbound = raw_assessment(model.copy(), table, given)
    built = built or (lambda variant: None)
    result.bound, options, (first, *rest) = plan_graphs(model.graph, options, result.decoder)
    result.options = options
    spare = model.copy() if rest and ahead is None or assess and writes else None  # before a pass touches it
    result.variants.append(_best_first(model, first.name, options.replace(**first.options), table, observe, result,
                                       suggest))
    built(result.variants[0])
    if assess and writes:  # after the first graph, whose weights copy meanwhile
        result.raw, result.unbound = raw_assessment(spare.copy() if rest else spare, table, given)
    placed = ahead.collect(result.options.rope_mode) if ahead is not None else None
    if placed is not None:
        result.variants += placed
        return result
    spare = spare or (model.fresh() if rest else None)
    for i, variant in enumerate(rest, 1):  # with the choices made on the first graph
        start = spare if i == len(rest) else spare.copy()
        result.variants.append(build_graph(start, variant.name, result.options.replace(**variant.options), table, None))
        built(result.variants[-1])
    return result


def plan_graphs(graph: gs.Graph, options: Options, dm: DecoderMap) -> tuple[dict[str, int], Options, list]:
    """The LLM defaults bound (`llm_defaults`), the options with them, and the graphs to write
    (`mtkc.passes.kv_cache.variants`), for the input's `graph`."""
    binds = options.passes is None or "bind-shapes" in options.passes
    bound = llm_defaults(graph, options, dm) if binds and "bind-shapes" not in options.skip_passes else {}
    options = options.replace(**bound)
    return bound, options, plan_variants(graph, options, dm)


def _best_first(model: Model, name: str, options: Options, table, observe, result: Build,
                suggest: bool) -> GraphVariant:
    """The first graph, with `rope_mode` as the rope pass left it: given, or picked when open
    (`mtkc.passes.rope_tables`); with `suggest`, the mode that would place better than the one given."""
    given = options.rope_mode
    first = build_graph(model, name, options, table, observe)
    rope = next((p for p in first.compiled.pipeline.passes if p.name == "rope"), None)
    mode = rope.mode if rope is not None else "table"
    result.options = result.options.replace(rope_mode=given or mode)
    better = rope.better if rope is not None else None
    if better and not given:  # the pass took it
        result.picked["rope_mode"] = f"{mode}: {better[1]}"
    elif better and given and suggest:
        result.suggested["rope_mode"] = f"{better[0]}: the {given} mode leaves {first.cpu_nodes} nodes of '{name}' " \
                                        f"on the CPU of SDK {table.version}; {better[1]}"
    return first


def build_graph(model: Model, name: str, options: Options, table, observe) -> GraphVariant:
    """One graph: `model.graph` through the pipeline (in place), then cut into partitions."""
    compiled = compile_graph(model, options, table, observe, label=name)
    for record in compiled.records:
        record.graph = name
    graph = model.graph
    verdict = lambda n: table.verdict(n, graph.opset, model.values)  # noqa: E731
    parts = split(graph, name, verdict, options.min_partition_nodes, options.force_cpu, options.force_npu)
    return GraphVariant(name, parts.entries, compiled.coverage, graph, compiled, parts)


def compile_graph(model: Model, options: Options, table, observe=None, label: str = "model") -> Compiled:
    """Run the pipeline on `model.graph` in place (a progress line `label: pass n/N` on a terminal);
    nothing is written."""
    ctx = Context(table, options, model.root, model.values)
    registry = load_registry(options.plugins)
    pipeline = resolve_pipeline(registry, ctx, options.passes, options.skip_passes)
    count("pipeline runs")
    with Progress(f"{label}: pass", total=len(pipeline.passes)) as progress:
        def step(p: Pass, graph: gs.Graph, touched: bool) -> None:
            progress.advance()
            if observe is not None:
                observe(p, graph, touched)

        records = run_pipeline(model.graph, pipeline, ctx, verify_each=options.verify_each, observe=step)
    if any(p.name == "bind-shapes" for p in pipeline.passes):
        _require_static(model.graph, ctx)
    final = assess(model.graph, table, model.graph.opset, model.values) if isinstance(table, Table) else None
    return Compiled(model, ctx, pipeline, records, final and final.coverage)


def raw_assessment(model: Model, table: Table, options: Options) -> tuple[Assessment, list[str]]:
    """The input's verdicts with dims bound as the user bound them (no pass but bind-shapes), and
    the input dims left symbolic."""
    unbound = bind_and_type(model.graph, Context(table, options, model.root))
    return assess(model.graph, table, model.opset, model.values), unbound


def bind_and_type(graph: gs.Graph, ctx: Context) -> list[str]:
    """Bind dims (the bind-shapes pass, which also infers), type every tensor, return the input
    dims still symbolic (each one leaves its consumers `shape-dynamic`)."""
    bind = BindShapes()
    if bind.applies(ctx):
        bind.run(graph, ctx)
    else:
        shapes.infer(graph, ctx.root)  # with onnxruntime's symbolic fallback
    return sorted({d for t in graph.inputs for d in t.shape or () if isinstance(d, str) and not d.isdigit()})


def llm_defaults(graph: gs.Graph, options: Options, dm: DecoderMap) -> dict[str, int]:
    """LLM_DEFAULTS for the shape options the user left unset whose dims are symbolic in the
    model's inputs (none when the user binds inputs by name with --input-shape)."""
    if options.input_shapes:
        return {}
    named, roles = roles_of(graph, dm), set()
    for t in graph.inputs:
        shape = list(t.shape or [])
        roles |= {role for axis, role in named[t.name].items() if not isinstance(shape[axis], int)}
    past = has_past(named)
    wanted = {"seq_len": bool(roles & {"seq", "total"}), "cache_len": past and bool(roles & {"cache", "total"}),
              "batch": "batch" in roles}
    return {key: LLM_DEFAULTS[key] for key, want in wanted.items() if want and getattr(options, key) is None}


def _require_static(graph: gs.Graph, ctx: Context) -> None:
    """A bound graph has static inputs: a dim no option names is an error naming the model's input
    (not the name a pass gave it: --input-shape takes the model's)."""
    for t in graph.inputs:
        dims = [d for d in t.shape or () if not isinstance(d, int)]
        if dims:
            name = ctx.model_name(t.name)
            called = f" ({t.name} in the compiled graph)" if name != t.name else ""
            raise InputError(f"input '{escape(name)}'{called}: dim '{dims[0]}' is still dynamic after binding; "
                             f"bind it with --input-shape {escape(name)}=D0,D1,...")
