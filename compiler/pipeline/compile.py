"""`compile_model`: load, run the pass pipeline, write the rewritten graph(s) and the manifest.

    load ─► plan variants ─► per variant: fresh graph ─► pipeline (pass manager) ─► partitions
         ─► write every graph through one WeightWriter + host tables + manifest ─► hand-off

`_variants` plans the graphs to write: `model`, or `prefill`/`decode` (per chunk) for a KV-cache
decoder (`mtkc.passes.kv_cache.variants`); each variant is the pipeline run on a fresh graph
(`Model.fresh`: the file is parsed once) with its option overrides. `_partitions` splits one graph into NPU/CPU pieces.
Every file (graphs, weights, manifest, reports, convert.sh, converter logs) is written into a
sibling staging folder swapped into place at the end (`mtkc.backend.staging`): OUT is complete or the
previous OUT is intact; an existing OUT is only replaced with `overwrite`. Same input + options -> byte-identical model, weights, manifest.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_graphsurgeon as gs

from mtkc import __version__
from mtkc.backend import manifest
from mtkc.backend.staging import check_target, staged
from mtkc.errors import InputError
from mtkc.ir.model import Model, load
from mtkc.ir.weights import WeightWriter
from mtkc.manager.pass_manager import PassRecord, Pipeline, load_registry, resolve_pipeline, run_pipeline
from mtkc.rewrite.pass_api import Context

# Compile options (keys of `options`; all optional); all but RUN_OPTIONS go in the manifest.
OUTPUT_OPTIONS = ("arch", "seq_len", "cache_len", "batch", "input_shapes", "passes", "skip_passes", "plugins",
                  "min_partition_nodes", "force_cpu", "force_npu", "converter_cmd")
RUN_OPTIONS = ("verify_each", "overwrite", "no_convert", "converter_timeout")
WEIGHTS_FILE = "weights.bin"  # shared by every graph written (each tensor stored once)


@dataclass
class GraphVariant:
    """One graph to write (`model`, or `prefill`/`decode`), and its partitions."""

    name: str
    graph: gs.Graph
    partitions: list[dict] = field(default_factory=list)
    split: Any = None  # mtkc.backend.stitch.Split: placements and the partition graphs to write
    compiled: Any = None  # Compiled: the pipeline run that produced `graph`


@dataclass
class Compiled:
    """The in-memory result of the pipeline (what `mtkc check` needs, nothing written)."""

    model: Model
    ctx: Context
    pipeline: Pipeline
    records: list[PassRecord]
    coverage: dict[str, Any]


@dataclass
class CompileResult:
    out_dir: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    records: list[PassRecord]
    variants: list[GraphVariant]


def normalise(options: dict[str, Any] | None) -> dict[str, Any]:
    """Every known option key present (None when not given); other keys are pass options
    (e.g. `kv_cache`, `rope_mode`) and pass through unchanged."""
    options = dict(options or {})
    for key in OUTPUT_OPTIONS + RUN_OPTIONS:
        options.setdefault(key, None)
    options["skip_passes"] = list(options["skip_passes"] or [])
    options["plugins"] = list(options["plugins"] or [])
    options["input_shapes"] = {k: list(v) for k, v in sorted((options["input_shapes"] or {}).items())}
    return options


def compile_model(model_path: str | os.PathLike, sdk: str, out_dir: str | os.PathLike, options: dict[str, Any] | None = None, table=None) -> CompileResult:
    """Compile `model_path` for `sdk` into `out_dir` (see the module docstring)."""
    from mtkc.runtime.generate import host_tables

    options = normalise(options)
    out = Path(out_dir)
    model = load(model_path)
    _check_out(out, model, bool(options["overwrite"]))
    if table is None:
        from mtkc.target.capability import load_table

        table = load_table(sdk, options["arch"])
    raw = _raw_coverage(model.fresh(), table, options)
    variants, tables = [], {}
    for i, (name, overrides) in enumerate(_variants(model.graph, options)):
        m = model if i == 0 else model.fresh()
        compiled = compile_graph(m, sdk, {**options, **overrides}, table)
        for record in compiled.records:
            record.graph = name
        variant = GraphVariant(name, m.graph, compiled=compiled)
        variant.partitions = _partitions(variant, compiled.ctx)
        variants.append(variant)
        for key, value in host_tables(compiled.pipeline.passes, m.values).items():
            tables.setdefault(key, value)
    by_graph = {v.name: v.compiled.coverage["compiled"] for v in variants}
    known = [c for c in by_graph.values() if c is not None]
    wiring = _wiring(variants)
    data = manifest.build(
        sdk=str(table.version),
        arch=getattr(table, "arch", None) or options["arch"],
        options={k: v for k, v in options.items() if k not in RUN_OPTIONS},
        graphs=[manifest.graph_entry(v.name, f"{v.name}.onnx", v.graph, v.partitions, wiring.get(v.name)) for v in variants],
        coverage={"raw": raw, "compiled": min(known) if known else None, "graphs": by_graph},
        passes=[r.stats() for v in variants for r in v.compiled.records],
    )
    report = _report(model, variants, data["coverage"])
    from mtkc.backend.deliver import finish  # hand-off to the converter, overlays, report.md, manifest.json

    with staged(out, bool(options["overwrite"])) as stage:  # OUT: all of this, or the previous OUT
        _write(stage, variants, data, tables, model.root)
        error = finish(stage, data, report, {v.name: (v.graph, v.split) for v in variants}, model.path,
                       getattr(table, "converter", None), options["converter_cmd"], options["no_convert"],
                       options["converter_timeout"])
    if error is not None:
        raise error  # exit 3 after the rename: OUT is complete, its logs/ say what the converter said
    return CompileResult(out, data, report, [r for v in variants for r in v.compiled.records], variants)


def compile_graph(model: Model, sdk: str, options: dict[str, Any], table=None, observe=None) -> Compiled:
    """Run the pipeline on `model.graph` in place; nothing is written.

    `observe(pass, graph)` runs after every pass (see `run_pipeline`).
    """
    options = normalise(options)
    if table is None:
        from mtkc.target.capability import load_table

        table = load_table(sdk, options["arch"])
    ctx = Context(table, options, model.root, model.values)
    registry = load_registry(options["plugins"])
    pipeline = resolve_pipeline(registry, ctx, options["passes"], options["skip_passes"])
    records = run_pipeline(model.graph, pipeline, ctx, verify_each=bool(options["verify_each"]), observe=observe)
    final = assessment(model.graph, ctx)
    return Compiled(model, ctx, pipeline, records, {"compiled": final and final.coverage})


def compiled_coverage(model: Model, table, options: dict[str, Any], watch: list[str]) -> tuple[float | None, dict[str, str]]:
    """Coverage after the pipeline (run in memory on `model.graph`), and for each node in `watch`
    the pass after which it is gone (rewritten) or supported: {node name: pass name}."""
    pending = set(watch)
    fixed: dict[str, str] = {}

    def track(p, graph: gs.Graph) -> None:
        nodes = {n.name: n for n in graph.nodes}
        for name in sorted(pending):
            node = nodes.get(name)
            if node is None or table.supports(node, graph.opset, model.values):
                fixed[name] = p.name
                pending.discard(name)

    compiled = compile_graph(model, table.version, {**options, "arch": table.arch}, table, observe=track)
    return compiled.coverage["compiled"], fixed


def assessment(graph: gs.Graph, ctx: Context):
    """`mtkc.pipeline.check.assess` of a graph (None when the table gives no verdicts, e.g. a stand-in)."""
    from mtkc.pipeline.check import assess
    from mtkc.target.capability import Table

    if not isinstance(ctx.table, Table):
        return None
    return assess(graph, ctx.table, graph.opset, ctx.read_values)


def _raw_coverage(model: Model, table, options: dict[str, Any]) -> float | None:
    """Coverage of the input as `mtkc check` computes it (shapes bound, no pass run)."""
    from mtkc.pipeline.check import check_model
    from mtkc.target.capability import Table

    if not isinstance(table, Table):
        return None
    shapes = {k: options[k] for k in ("seq_len", "cache_len", "batch")}
    report = check_model(model, table, {**shapes, "input_shapes": options["input_shapes"] or None}, compiled=False)
    return report.assessment.coverage


def _variants(graph: gs.Graph, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The graphs to write as (name, option overrides): `model`, or prefill/decode for KV cache."""
    from mtkc.passes.kv_cache import variants

    return [(v.name, v.options) for v in variants(graph, options)]


def _wiring(variants: list[GraphVariant]) -> dict[str, dict[str, dict]]:
    """Graph inputs made by another graph: chunk k's `hidden_states` is chunk k-1's `hidden_states_out`
    (same variant; `layer-chunks`). {graph name: {input name: {"graph", "output"}}}."""
    made = {(v.compiled.ctx.options.get("variant"), v.compiled.ctx.options.get("chunk")): v for v in variants}
    wiring = {}
    for v in variants:
        o = v.compiled.ctx.options
        prev = made.get((o.get("variant"), (o.get("chunk") or 0) - 1))
        if prev and any(t.name == "hidden_states" for t in v.graph.inputs) and \
                any(t.name == "hidden_states_out" for t in prev.graph.outputs):
            wiring[v.name] = {"hidden_states": {"graph": prev.name, "output": "hidden_states_out"}}
    return wiring


def _partitions(variant: GraphVariant, ctx: Context) -> list[dict]:
    """Hook: NPU/CPU partitions of one graph, in execution order (manifest `partitions`)."""
    from mtkc.backend.stitch import split

    o, graph = ctx.options, variant.graph
    variant.split = split(graph, variant.name, lambda n: ctx.table.verdict(n, graph.opset, ctx.read_values),
                          o.get("min_partition_nodes"), o.get("force_cpu"), o.get("force_npu"))
    return variant.split.entries


def _report(model: Model, variants: list[GraphVariant], coverage: dict[str, Any]) -> dict[str, Any]:
    """report.json: the manifest's facts plus what is only diagnostic (timings, misses, versions)."""
    import importlib.metadata as md

    versions = {"mtkc": __version__}
    for dist in ("onnx", "onnxruntime", "onnx-graphsurgeon", "numpy", "protobuf"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "schema_version": manifest.SCHEMA_VERSION,
        "input": {"file": model.path.name, "sha256": _sha256(model.path)},
        "versions": versions,
        "pipeline": {v.name: v.compiled.pipeline.names for v in variants},
        "skipped": [{"graph": v.name, "name": n, "reason": r} for v in variants for n, r in v.compiled.pipeline.skipped],
        "passes": [
            {**r.stats(), "origin": r.origin, "seconds": round(r.seconds, 3),
             "misses": [{"node": m.node, "reason": m.reason} for m in r.misses], "notes": r.notes}
            for v in variants for r in v.compiled.records
        ],
        "coverage": coverage,
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- output ---------------------------------------------------------------------------------


def _check_out(out: Path, model: Model, overwrite: bool) -> None:
    """OUT must not contain or be the input's folder/files; existing OUT needs `overwrite`."""
    target = out.resolve()
    inputs = [model.path.resolve(), model.root] + _external_files(model)
    for item in inputs:
        if target == item or target in item.parents:
            raise InputError(f"{out}: output folder overlaps the input model ({item.name}); choose another -o")
    check_target(out, overwrite)  # exists: only a folder mtkc wrote, with --overwrite


def _external_files(model: Model) -> list[Path]:
    from mtkc.ir.model import external_info

    files = set()
    for t in model.graph.tensors().values():
        lazy = getattr(t, "_values", None)
        if isinstance(lazy, gs.ir.tensor.LazyValues):
            info = external_info(lazy.tensor)
            if info:
                files.add((model.root / info["location"]).resolve())
    return sorted(files)


def _write(stage: Path, variants: list[GraphVariant], data: dict, tables: dict, root: Path) -> None:
    """Every graph, partition and host table into the staging folder (the text files: `deliver.finish`)."""
    from mtkc.runtime.generate import write_host_tables

    with WeightWriter(stage, WEIGHTS_FILE) as writer:
        for variant in variants:
            writer.export(variant.graph, root, stage / f"{variant.name}.onnx")
            for piece in variant.split.pieces if variant.split else []:
                writer.export(piece.graph, root, stage / piece.entry["path"])
    if tables:
        data["host"] = write_host_tables(stage, tables)
