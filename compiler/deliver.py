"""After compile has written OUT: hand off to the converter, then write what people read.

    OUT/convert.sh, logs/, dla/       handoff.run (converter, when present)
    OUT/<graph>.placement.json        Model Explorer overlay per graph
    OUT/report.md                     human-readable report
    OUT/report.json, manifest.json    rewritten last (atomic) with placement + converter facts

Runs on the final OUT (after the staged rename) so converter logs name real paths; a converter
failure leaves a complete OUT behind and is returned for the caller to raise (exit 3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import onnx_graphsurgeon as gs

from mtkc import handoff, report
from mtkc.errors import ConverterError
from mtkc.stitch import Split


def finish(
    out: str | Path,
    manifest: dict,
    report_data: dict,
    splits: Mapping[str, tuple[gs.Graph, Split]],
    model_path: str | Path,
    converter: Mapping[str, str] | None = None,
    converter_cmd: str | None = None,
    no_convert: bool = False,
) -> ConverterError | None:
    """`splits`: graph name -> (gs graph, Split). Updates `manifest` and `report_data` in place."""
    out = Path(out)
    manifest["model"] = {"path": str(Path(model_path).resolve())}
    report_data["placement"] = {name: report.placement(graph, s.parts, s.placements) for name, (graph, s) in splits.items()}
    placed = [p for facts in report_data["placement"].values() for p in (facts["npu_nodes"], facts["nodes"])]
    if isinstance(manifest.get("coverage"), dict) and placed:  # nodes placed on the NPU (after min size, overrides)
        manifest["coverage"]["placed"] = round(sum(placed[0::2]) / max(1, sum(placed[1::2])), 6)
    result = handoff.run(out, manifest, converter, converter_cmd, bool(no_convert))
    manifest["converter"] = result.section
    report_data["converter"] = result.section
    for name, (_, s) in splits.items():
        _replace(out / f"{name}.placement.json", _json(report.overlay(name, s.placements, str(manifest.get("sdk")))))
    _replace(out / "report.md", report.markdown(manifest, report_data))
    _replace(out / "report.json", _json(report_data))
    _replace(out / "manifest.json", _json(manifest))
    return result.error


def _json(data: dict) -> str:
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _replace(path: Path, text: str) -> None:
    """Write beside, fsync, rename over: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


