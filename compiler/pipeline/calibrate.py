"""`calibrate`: the inputs every NPU partition sees on real prompts, stored for quantisation.

    prompts ─► Generator (reference runtime, graphs run as their partitions) ─► per prompt:
               prefill calls (T tokens each), then K greedy decode calls (the cache fills)
            ─► every NPU partition call: its inputs ─► OUT/calibration/<graph>.<partition>/NNNN.npz

Also written: `ranges.json` (per partition, per input tensor: min, max, absmax, percentiles) and
`index.json` (per sample: prompt, graph, step, file), then the manifest's `calibration` entry.
The folder is written through `mtkc.backend.staging` (complete or the previous one intact);
the disk it needs is computed from the manifest's shapes before anything runs.
Deterministic: same OUT and prompts give the same bytes (npz entries carry a fixed timestamp).
"""

from __future__ import annotations

import logging
import math
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mtkc.backend.calibration_data import FOLDER, folder_name
from mtkc.backend.deliver import _write
from mtkc.backend.manifest import dumps
from mtkc.backend.staging import staged
from mtkc.errors import InputError
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.generate import Generator
from mtkc.runtime.partitioned import partition_sessions, use_partitions
from mtkc.runtime.prompts import Prompt, check_vocab

log = logging.getLogger("mtkc")

MIN_SAMPLES = 200  # MediaTek's guidance: 200-500 representative prompts
PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)
SUBSAMPLE = 4096  # values kept per tensor per sample for the percentiles
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass
class Plan:
    """Samples per NPU partition folder (upper bound: decode stops early when the cache fills) and bytes."""

    samples: dict[str, int] = field(default_factory=dict)
    bytes: int = 0


def npu_partitions(manifest: dict) -> list[tuple[dict, dict]]:
    return [(g, p) for g in manifest.get("graphs", []) for p in g["partitions"] if p["target"] == "npu"]


def plan(manifest: dict, prompts: list[Prompt], tokens_per_prefill: int, decode_steps: int) -> Plan:
    """What a run will store, from the manifest's partition input shapes (nothing runs)."""
    result = Plan()
    prefill = sum(math.ceil(len(p.ids) / tokens_per_prefill) for p in prompts)
    decode = decode_steps * len(prompts)
    for graph, part in npu_partitions(manifest):
        calls = prefill if graph["name"].startswith("prefill") else decode if graph["name"].startswith("decode") else len(prompts)
        result.samples[folder_name(graph, part)] = calls
        result.bytes += calls * sum(_nbytes(i) for i in part["inputs"])
    return result


def calibrate(out: str | Path, prompts: list[Prompt], decode_steps: int = 8, max_bytes: int | None = None) -> dict:
    """Run every prompt, store each NPU partition's inputs; returns the manifest's `calibration` entry."""
    out = Path(out)
    if decode_steps < 0:
        raise InputError(f"--decode-steps {decode_steps}: must be >= 0")
    manifest = load_manifest(out)
    generator = Generator(out)
    if not npu_partitions(manifest):
        raise InputError(f"{out}/manifest.json: no NPU partition to calibrate")
    for prompt in prompts:
        check_vocab(prompt, generator.vocab)  # before anything is written, naming the prompt's line
    expected = plan(manifest, prompts, generator.prefill[0].tokens, decode_steps)
    log.info("mtkc: calibration: %d prompt(s) -> %s, %s on disk", len(prompts),
             ", ".join(f"{k}: {n} samples" for k, n in expected.samples.items()), _size(expected.bytes))
    if max_bytes is not None and expected.bytes > max_bytes:
        raise InputError(f"calibration needs {_size(expected.bytes)} ({expected.bytes} bytes), more than "
                         f"--max-bytes {max_bytes}; use fewer prompts (--samples) or --decode-steps")
    _warn_thin(prompts, expected)
    recorder = Recorder()
    use_partitions(generator, manifest, partition_sessions(out, manifest, recorder.tap))
    with staged(out / FOLDER, overwrite=True, foreign=_foreign) as stage:
        recorder.root = stage
        for k, prompt in enumerate(prompts):
            recorder.start(k)
            try:
                generator.generate(prompt.ids, decode_steps + 1)
            except InputError as exc:
                raise InputError(f"{prompt.where}: {exc}") from None
        index = {"prompts": [{"ids": p.ids, **({"text": p.text} if p.text is not None else {})} for p in prompts],
                 "decode_steps": decode_steps, "samples": recorder.index}
        _write(stage / "index.json", dumps(index))
        _write(stage / "ranges.json", dumps(recorder.ranges()))
    entry = {"path": FOLDER, "index": f"{FOLDER}/index.json", "ranges": f"{FOLDER}/ranges.json",
             "prompts": len(prompts), "decode_steps": decode_steps, "samples": recorder.counts()}
    manifest["calibration"] = entry
    save_manifest(out, manifest)
    return entry


def save_manifest(out: Path, manifest: dict) -> None:
    """Replace OUT/manifest.json in one rename (readers see the old or the new file)."""
    tmp = Path(out) / ".manifest.json.mtkc-tmp"
    _write(tmp, dumps(manifest))
    os.replace(tmp, Path(out) / "manifest.json")


class Recorder:
    """The partition tap: writes each NPU partition's inputs and keeps what ranges.json needs."""

    def __init__(self):
        self.root: Path | None = None
        self.index: list[dict] = []
        self.prompt = 0
        self.steps: dict[str, int] = {}
        self.stats: dict[str, dict[str, dict]] = {}
        self.numbers: dict[str, int] = {}  # samples written per folder

    def start(self, prompt: int) -> None:
        self.prompt, self.steps = prompt, {}

    def tap(self, graph: dict, part: dict, inputs: dict[str, np.ndarray], outputs: dict) -> None:
        if part["target"] != "npu":
            return
        name = folder_name(graph, part)
        step = self.steps.get(graph["name"], 0)
        self.steps[graph["name"]] = step + 1
        number = self.numbers.get(name, 0)
        self.numbers[name] = number + 1
        (self.root / name).mkdir(exist_ok=True)
        file = f"{number:04d}.npz"
        save_npz(self.root / name / file, {i["name"]: inputs[i["name"]] for i in part["inputs"]})
        self.index.append({"dir": name, "file": file, "prompt": self.prompt, "graph": graph["name"], "step": step})
        stats = self.stats.setdefault(name, {})
        for key, value in inputs.items():
            s = stats.setdefault(key, {"min": math.inf, "max": -math.inf, "values": []})
            flat = np.asarray(value).ravel()
            s["min"] = min(s["min"], float(flat.min()))
            s["max"] = max(s["max"], float(flat.max()))
            s["values"].append(flat[:: max(1, flat.size // SUBSAMPLE)].astype(np.float64))

    def counts(self) -> dict[str, int]:
        return dict(sorted(self.numbers.items()))

    def ranges(self) -> dict:
        """{folder: {tensor: {min, max, absmax, p0.1 ... p99.9}}}; percentiles over a strided subsample."""
        result = {}
        for name, tensors in sorted(self.stats.items()):
            result[name] = {}
            for key, s in sorted(tensors.items()):
                values = np.concatenate(s["values"])
                entry = {"min": s["min"], "max": s["max"], "absmax": max(abs(s["min"]), abs(s["max"]))}
                entry.update((f"p{q:g}", float(v)) for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES)))
                result[name][key] = entry
        return result


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez` with fixed zip timestamps (same arrays -> same bytes)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_TIME)
            with archive.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arrays[key]), allow_pickle=False)


def _warn_thin(prompts: list[Prompt], expected: Plan) -> None:
    thin = {k: n for k, n in expected.samples.items() if n < MIN_SAMPLES}
    if thin:
        log.warning("mtkc: warning: %s: fewer than %d calibration samples (MediaTek's converter wants 200-500 "
                    "representative prompts); add prompts or --decode-steps",
                    ", ".join(f"{k} has {n}" for k, n in thin.items()), MIN_SAMPLES)
    lengths = [len(p.ids) for p in prompts]
    low, high = min(lengths), max(lengths)
    if len(prompts) > 1 and (len(set(lengths)) < 3 or high - low < 0.25 * np.mean(lengths)):
        log.warning("mtkc: warning: prompt lengths barely vary (%d distinct, %d..%d tokens); "
                    "mix short and long prompts", len(set(lengths)), low, high)


def _nbytes(spec: dict) -> int:
    return int(np.prod(spec["shape"] or [1])) * np.dtype(spec["dtype"]).itemsize


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


_OWN = re.compile(r"index\.json|ranges\.json|[^/]+|[^/]+/\d+\.npz")


def _foreign(folder: Path) -> str | None:
    """Why `folder` is not a calibration set mtkc wrote (then it is never replaced), or None."""
    if any(folder.iterdir()) and not (folder / "index.json").is_file():
        return "no index.json"
    for path in sorted(folder.rglob("*")):
        entry = path.relative_to(folder).as_posix()
        if path.is_symlink() or not _OWN.fullmatch(entry) or (path.is_dir() and "/" in entry):
            return f"holds '{entry}'"
    return None

