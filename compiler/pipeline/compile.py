"""`compile_model`: build in memory (`mtkc.pipeline.build`), writing each graph as it is built, then
the manifest.

    load ─► build (defaults, choices, per graph: pipeline ─► partitions ─► written: graph files,
                   partitions, host tables through one WeightWriter)
         ─► weights closed ─► manifest ─► hand-off

Each graph is written as soon as it is built, so its weights copy (I/O, in the WeightWriter's
copier process) while the next graph builds; when OUT's parent folder does not exist yet, only once
every graph is built, so a failing build creates no folder. Every file (graphs, weights, manifest,
reports, convert.sh, converter logs) is written into a sibling staging folder swapped into place at
the end (`mtkc.backend.staging`): OUT is complete or the previous OUT is intact; an existing OUT is
only replaced with `overwrite`. Without an OUT, `default_output` names a new folder in the current
directory (never an existing one). Same input + options -> byte-identical model, weights, manifest.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_graphsurgeon as gs

from mtkc import __version__
from mtkc.backend import manifest
from mtkc.backend.deliver import finish
from mtkc.backend.staging import Stage, check_target, disk_errors
from mtkc.display import Progress
from mtkc.errors import InputError
from mtkc.ir import copier
from mtkc.ir.graph_utils import tensor_map
from mtkc.ir.model import Model, external_info, load
from mtkc.ir.weights import WeightWriter
from mtkc.manager.pass_manager import PassRecord
from mtkc.options import Options, normalize_sdk, of
from mtkc.pipeline.build import Build, GraphVariant, build
from mtkc.runtime.generate import host_tables, write_host_tables
from mtkc.target.capability import load_table

log = logging.getLogger("mtkc")

WEIGHTS_FILE = "weights.bin"  # shared by every graph written (each tensor stored once)


@dataclass
class CompileResult:
    out_dir: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    records: list[PassRecord]
    variants: list[GraphVariant]
    build: Build


def default_output(model_path: str | os.PathLike, sdk: str, cwd: str | os.PathLike = ".") -> Path:
    """`<model stem>.mtkc-<sdk>` in `cwd`, or with `-2`, `-3`, ... when that exists."""
    base = f"{Path(model_path).stem}.mtkc-{normalize_sdk(sdk)}"
    for n in range(1, 10000):
        candidate = Path(cwd) / (base if n == 1 else f"{base}-{n}")
        if not os.path.lexists(candidate):
            return candidate
    raise InputError(f"{cwd}: every default output name {base}-N is taken; choose one with -o")


def compile_model(model_path: str | os.PathLike, sdk: str, out_dir: str | os.PathLike,
                  options: Options | dict[str, Any] | None = None, table=None) -> CompileResult:
    """Compile `model_path` for `sdk` into `out_dir` (see the module docstring)."""
    options = of(options).replace(sdk=normalize_sdk(sdk))
    out = Path(out_dir)
    copier.prestart()  # the weights' copier, forked while this process is small
    try:
        model = load(model_path)
        _check_out(out, model, options.overwrite)
        if table is None:
            table = load_table(sdk, options.arch)
        output = _Output(out, options.overwrite, model.root)
        try:
            return _compile(model, options, table, output)
        finally:
            output.discard()  # after a publish: the previous OUT; else the unpublished staging
    finally:
        copier.discard()


def _compile(model: Model, options: Options, table, output: _Output) -> CompileResult:
    result = build(model, options, table, built=output.early)
    if result.bound:
        log.info("mtkc: bound dims the options left open to MediaTek's LLM defaults: %s (set %s to choose)",
                 ", ".join(f"{k}={v}" for k, v in result.bound.items()),
                 "/".join(f"--{k.replace('_', '-')}" for k in result.bound))
    for key, why in result.picked.items():
        log.info("mtkc: picked %s=%s (set --%s to choose)", key, why, key.replace("_", "-"))
    variants, options = result.variants, result.options
    for note in (n for r in variants[0].compiled.records if r.name in ("bind-shapes", "gqa") for n in r.notes):
        log.info("mtkc: %s", note)  # inputs the binding removed, options it ignored, a window the export dropped
    by_graph = {v.name: v.compiled.coverage for v in variants}
    known = [c for c in by_graph.values() if c is not None]
    wiring = _wiring(variants)
    data = manifest.build(
        sdk=str(table.version),
        arch=getattr(table, "arch", None) or options.arch,
        options=options.manifest(),
        graphs=[{**manifest.graph_entry(v.name, f"{v.name}.onnx", v.graph, v.partitions, wiring.get(v.name)),
                 "decoder": manifest.decoder_entry(v.graph)} for v in variants],
        coverage={"raw": result.raw and result.raw.coverage, "compiled": min(known) if known else None, "graphs": by_graph},
        passes=[r.stats() for v in variants for r in v.compiled.records],
    )
    report = _report(model, variants, data["coverage"])
    stage = output.complete(variants, data)
    with disk_errors(output.out):
        error = finish(stage, data, report, {v.name: (v.graph, v.split) for v in variants}, model.path,
                       getattr(table, "converter", None), options.converter_cmd, options.no_convert,
                       options.converter_timeout)
    output.stage.publish()  # OUT: all of this, or the previous OUT
    if error is not None:
        raise error  # exit 3 after the rename: OUT is complete, its logs/ say what the converter said
    return CompileResult(output.out, data, report, [r for v in variants for r in v.compiled.records], variants,
                         result)


def _wiring(variants: list[GraphVariant]) -> dict[str, dict[str, dict]]:
    """Graph inputs made by another graph: chunk k's `hidden_states` is chunk k-1's `hidden_states_out`
    (same variant; `layer-chunks`). {graph name: {input name: {"graph", "output"}}}."""
    made = {(v.compiled.ctx.options.variant, v.compiled.ctx.options.chunk): v for v in variants}
    wiring = {}
    for v in variants:
        o = v.compiled.ctx.options
        prev = made.get((o.variant, o.chunk - 1))
        if prev and any(t.name == "hidden_states" for t in v.graph.inputs) and \
                any(t.name == "hidden_states_out" for t in prev.graph.outputs):
            wiring[v.name] = {"hidden_states": {"graph": prev.name, "output": "hidden_states_out"}}
    return wiring


def _report(model: Model, variants: list[GraphVariant], coverage: dict[str, Any]) -> dict[str, Any]:
    """report.json: the manifest's facts plus what is only diagnostic (timings, misses, versions)."""
    versions = {"mtkc": __version__}
    for dist in ("onnx", "onnxruntime", "onnx-graphsurgeon", "numpy", "protobuf"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "schema_version": manifest.SCHEMA_VERSION,
        "input": {"file": model.path.name, "sha256": manifest.sha256(model.path)},
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
    files = set()
    for t in tensor_map(model.graph).values():
        lazy = getattr(t, "_values", None)
        if isinstance(lazy, gs.ir.tensor.LazyValues):
            info = external_info(lazy.tensor)
            if info:
                files.add((model.root / info["location"]).resolve())
    return sorted(files)


class _Output:
    """OUT while it is written: the staging folder and the shared weights file, opened by the first
    graph written (see the module docstring for when that is)."""

    def __init__(self, out: Path, overwrite: bool, root: Path):
        self.out, self.overwrite, self.root = out, overwrite, root
        self.eager = Path(os.path.abspath(out)).parent.is_dir()
        self.stage: Stage | None = None
        self.writer: WeightWriter | None = None
        self.written = 0  # graphs written, in build order
        self.host: dict[str, dict] = {}  # host tables written: the manifest's `host` entry

    def early(self, variant: GraphVariant) -> None:
        """`build`'s `built`: write the graph now when OUT's parent folder exists."""
        if self.eager:
            self._add(variant)

    def complete(self, variants: list[GraphVariant], data: dict) -> Path:
        """The graphs not written yet, the weights file closed (its copies done), the manifest's
        `host` entry; returns the staging folder."""
        files = [1 + len(v.split.pieces if v.split else []) for v in variants]
        with disk_errors(self.out), Progress("write", total=sum(files), unit="file") as progress:
            progress.advance(sum(files[:self.written]))
            for variant in variants[self.written:]:
                self._add(variant, progress)
            self.writer.close()
            self.writer = None  # closed: the files stay
        if self.host:
            data["host"] = dict(sorted(self.host.items()))
        return self.stage.path

    def discard(self) -> None:
        """Whatever was not published: the weights file's copies stopped, the staging folder removed."""
        if self.writer is not None:
            self.writer.abort()
        if self.stage is not None:
            self.stage.discard()

    def _add(self, variant: GraphVariant, progress: Progress | None = None) -> None:
        """Every graph and partition of `variant` into the staging folder, and the host tables its
        passes made that an earlier graph's did not."""
        with disk_errors(self.out):
            if self.stage is None:
                self.stage = Stage(self.out, self.overwrite)
                self.writer = WeightWriter(self.stage.path, WEIGHTS_FILE)
            pieces = variant.split.pieces if variant.split else []
            for graph, name in [(variant.graph, f"{variant.name}.onnx"), *((p.graph, p.entry["path"]) for p in pieces)]:
                self.writer.export(graph, self.root, self.stage.path / name)
                if progress is not None:
                    progress.advance()
            tables = host_tables(variant.compiled.records, variant.compiled.model.values)
            self.host.update(write_host_tables(self.stage.path, {k: t for k, t in tables.items() if k not in self.host},
                                               self.writer))
        self.written += 1
