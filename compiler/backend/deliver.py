"""After compile has written the graphs: hand off to the converter, then write what people read.

    (nothing written)             runcheck.check_runs: every graph loads and runs in onnxruntime
    convert.sh, logs/, dla/       handoff.run (converter, when present; runs inside the folder)
    <graph>.placement.json        Model Explorer overlay per graph
    report.md                     human-readable report
    report.json, manifest.json    with placement + converter facts

`out` is compile's staging folder (`mtkc.backend.staging`): everything here, the converter run included,
happens before OUT is swapped into place, so an error or Ctrl-C leaves the previous OUT intact.
Paths in convert.sh, the logs and the JSON are relative to the folder, so they stay valid after
the rename. A converter failure is returned, not raised: compile still puts the complete folder
(logs/ included, for the user to read) in place, then raises it (exit 3).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import onnx_graphsurgeon as gs

from mtkc import __version__
from mtkc.backend import handoff, report
from mtkc.backend.manifest import dumps, source
from mtkc.backend.runcheck import check_runs
from mtkc.backend.staging import MARK
from mtkc.backend.stitch import Split
from mtkc.errors import ConverterError


def finish(
    out: str | Path,
    manifest: dict,
    report_data: dict,
    splits: Mapping[str, tuple[gs.Graph, Split]],
    model_path: str | Path,
    converter: Mapping[str, str] | None = None,
    converter_cmd: str | None = None,
    no_convert: bool = False,
    converter_timeout: float | None = None,
) -> ConverterError | None:
    """`splits`: graph name -> (gs graph, Split). Updates `manifest` and `report_data` in place."""
    out = Path(out)
    check_runs(out, manifest)  # every graph written loads and runs, or nothing is published
    manifest[MARK] = __version__  # with schema_version: how --overwrite recognises a folder mtkc wrote
    manifest["model"] = source(str(Path(model_path).resolve()), (report_data.get("input") or {}).get("sha256"))
    report_data["placement"] = {name: report.placement(graph, s.parts, s.placements) for name, (graph, s) in splits.items()}
    placed = [p for facts in report_data["placement"].values() for p in (facts["npu_nodes"], facts["nodes"])]
    if isinstance(manifest.get("coverage"), dict) and placed:  # nodes placed on the NPU (after min size, overrides)
        manifest["coverage"]["placed"] = round(sum(placed[0::2]) / max(1, sum(placed[1::2])), 6)
    result = handoff.run(out, manifest, converter, converter_cmd, bool(no_convert), timeout=converter_timeout)
    manifest["converter"] = result.section
    report_data["converter"] = result.section
    for name, (_, s) in splits.items():
        _write(out / f"{name}.placement.json", dumps(report.overlay(name, s.placements, str(manifest.get("sdk")))))
    _write(out / "report.md", report.markdown(manifest, report_data))
    _write(out / "report.json", dumps(report_data))
    _write(out / "manifest.json", dumps(manifest))
    return result.error


def _write(path: Path, text: str) -> None:
    """Write and fsync (the folder rename that publishes it must not outrun the data)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


