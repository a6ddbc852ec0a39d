"""`mtkc convert OUT --quant SCHEME`: the quantising hand-off (`mtkc.backend.quant_handoff`) run on a
compiled, calibrated folder."""

from __future__ import annotations

from pathlib import Path

from mtkc.backend import handoff
from mtkc.backend.quant_handoff import PRECISION, Quant
from mtkc.errors import InputError
from mtkc.backend.calibration_data import check_samples, folder_name, sample_files
from mtkc.pipeline.calibrate import npu_partitions, save_manifest
from mtkc.pipeline.verify import load_manifest
from mtkc.target.capability import load_table


def convert(out: str | Path, scheme: str, converter_cmd: str | None = None, no_convert: bool = False) -> dict:
    """`mtkc convert OUT --quant SCHEME`: hand every NPU partition to the converter with its samples;
    rewrites convert.sh and the manifest's `converter` section. Returns that section."""
    if scheme not in PRECISION:
        raise InputError(f"--quant {scheme}: expected one of {', '.join(PRECISION)}")
    out = Path(out)
    manifest = load_manifest(out)
    for graph, part in npu_partitions(manifest):  # every sample checked before the converter sees one
        check_samples(sample_files(out, manifest, folder_name(graph, part)), part["inputs"])
    table = load_table(str(manifest["sdk"]), manifest.get("arch"))
    result = handoff.run(out, manifest, getattr(table, "converter", None), converter_cmd, no_convert, quant=Quant(scheme))
    manifest["converter"] = result.section
    save_manifest(out, manifest)
    if result.error is not None:
        raise result.error
    return result.section
