"""`mtkc convert OUT --quant SCHEME`: the quantising hand-off (`mtkc.backend.quant_handoff`) run on a
compiled, calibrated folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from mtkc.backend import handoff
from mtkc.backend.quant_handoff import PRECISION, Quant
from mtkc.errors import InputError
from mtkc.backend.calibration_data import check_samples, folder_name, sample_files
from mtkc.pipeline.calibrate import npu_partitions, save_manifest
from mtkc.pipeline.quantplan import Units, read_plan, unit_key
from mtkc.pipeline.verify import load_manifest
from mtkc.target.capability import load_table


def convert(out: str | Path, scheme: str, converter_cmd: str | None = None, no_convert: bool = False,
            plan: str | Path | None = None) -> dict:
    """`mtkc convert OUT --quant SCHEME [--plan FILE]`: hand every NPU partition to the converter with its
    samples; rewrites convert.sh and the manifest's `converter` section. Returns that section."""
    if scheme not in PRECISION:
        raise InputError(f"--quant {scheme}: expected one of {', '.join(PRECISION)}")
    out = Path(out)
    manifest = load_manifest(out)
    for graph, part in npu_partitions(manifest):  # every sample checked before the converter sees one
        check_samples(sample_files(out, manifest, folder_name(graph, part)), part["inputs"])
    settings = plan_settings(out, manifest, scheme, plan) if plan else None
    table = load_table(str(manifest["sdk"]), manifest.get("arch"))
    result = handoff.run(out, manifest, getattr(table, "converter", None), converter_cmd, no_convert,
                         quant=Quant(scheme, settings))
    manifest["converter"] = result.section
    save_manifest(out, manifest)
    if result.error is not None:
        raise result.error
    return result.section


def plan_settings(out: Path, manifest: dict, scheme: str, path: str | Path) -> dict:
    """A plan's per-unit settings for the converter: each raised unit's scheme, precision and MatMul
    nodes, and every precision's share of the NPU partitions' MatMul/Gemm weight elements."""
    base, units = read_plan(path)
    if base != scheme:
        raise InputError(f"--plan {path}: the plan is for {base}, not --quant {scheme}")
    shares: dict[str, int] = {}
    nodes: dict = {u: [] for u in units}
    known = Units(out, manifest)
    for graph_entry, part in npu_partitions(manifest):
        graph = onnx.load(str(out / part["path"]), load_external_data=False).graph
        dims = {t.name: list(t.dims) for t in graph.initializer}
        for node in graph.node:
            weight = node.input[1] if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 else None
            if weight not in dims:
                continue
            unit = known.of(graph_entry["name"], node.name)
            precision = PRECISION[units.get(unit, scheme)]
            shares[precision] = shares.get(precision, 0) + int(np.prod(dims[weight]))
            if unit in nodes:
                nodes[unit].append(node.name)
    missing = [u for u, found in nodes.items() if not found]
    if missing:
        raise InputError(f"--plan {path}: unit '{missing[0]}' has no MatMul in the NPU partitions")
    total = sum(shares.values()) or 1
    return {"source": Path(path).name, "units": {unit_key(u): s for u, s in units.items()},
            "precisions": {unit_key(u): PRECISION[s] for u, s in units.items()},
            "nodes": {unit_key(u): found for u, found in nodes.items()},
            "proportion": {k: round(v / total, 6) for k, v in sorted(shares.items())}}
