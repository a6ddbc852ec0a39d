"""`calibrate`: the inputs every NPU partition sees on real prompts, stored for quantisation.

    prompts ─► Generator (reference runtime, graphs run as their partitions) ─► per prompt:
               prefill calls (T tokens each), then K greedy decode calls (the cache fills)
            ─► every NPU partition call: its inputs ─► OUT/calibration/<graph>.<partition>/NNNN.npz
               (every prefill call; `decode_samples` of the K decode calls per prompt)

Storage: a float32 input is stored as float16 when every value fits (|x| <= 65504), else as
float32; readers cast each array back to the partition input's dtype (`backend.calibration_data.read_sample`). The index
and the manifest entry say so (`float32_as`). Every call, stored or not, feeds `ranges.json` (per
partition, per input tensor: min, max, absmax, percentiles from a log-binned histogram: memory
bounded whatever the prompt count). Also written: `index.json` (per sample: prompt, graph, step,
file), then the manifest's `calibration` entry. The partition sessions are opened once, over one
copy of the weights (read once: `Sessions(resident=True)`), and the whole-graph sessions dropped before the first prompt. The folder is
written through `mtkc.backend.staging` (complete or the previous one intact); the disk it needs is
computed from the manifest's shapes before anything runs, and `max_bytes` also bounds what is
actually written. Deterministic: same OUT and prompts give the same bytes (fixed zip timestamps).
"""

from __future__ import annotations

import logging
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mtkc.backend.calibration_data import FOLDER, folder_name
from mtkc.backend.deliver import _write
from mtkc.backend.owned import calibration_files, foreign_file
from mtkc.backend.manifest import dumps
from mtkc.backend.staging import replace_file, staged
from mtkc.display import Progress
from mtkc.errors import InputError
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.generate import Generator
from mtkc.runtime.partitioned import partition_sessions, use_partitions
from mtkc.runtime.prompts import Prompt, check_vocab
from mtkc.runtime.sessions import Sessions

log = logging.getLogger("mtkc")

MIN_SAMPLES = 200  # MediaTek's guidance: 200-500 representative prompts
PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)
SUBSAMPLE = 4096  # values per tensor per call that enter the histogram (strided)
FLOAT32_AS = "float16"  # storage of float32 inputs whose values fit it
FLOAT16_MAX = 65504.0
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_HEADERS = 384  # bytes of one array's npy header and zip entries besides its name, rounded up


@dataclass
class Plan:
    """Samples per NPU partition folder (upper bound: decode stops early when the cache fills) and bytes."""

    samples: dict[str, int] = field(default_factory=dict)
    bytes: int = 0


def npu_partitions(manifest: dict) -> list[tuple[dict, dict]]:
    return [(g, p) for g in manifest.get("graphs", []) for p in g["partitions"] if p["target"] == "npu"]


def plan(manifest: dict, prompts: list[Prompt], tokens_per_prefill: int, decode_steps: int,
         decode_samples: int | None = None) -> Plan:
    """What a run will store, from the manifest's partition input shapes (nothing runs); float32
    inputs counted as float16. `decode_samples`: decode calls stored per prompt (default: all)."""
    result = Plan()
    prefill = sum(math.ceil(len(p.ids) / tokens_per_prefill) for p in prompts)
    decode = len(stored_steps(0, decode_steps, decode_samples)) * len(prompts)
    for graph, part in npu_partitions(manifest):
        calls = prefill if graph["name"].startswith("prefill") else decode if graph["name"].startswith("decode") else len(prompts)
        result.samples[folder_name(graph, part)] = calls
        result.bytes += calls * sample_bytes(part)
    return result


def stored_steps(prompt: int, decode_steps: int, decode_samples: int | None) -> list[int]:
    """The decode steps of prompt number `prompt` whose inputs are stored: `decode_samples` of the
    `decode_steps`, evenly spaced and rotated by the prompt so every step is sampled across prompts."""
    if decode_samples is None or decode_samples >= decode_steps:
        return list(range(decode_steps))
    return sorted({(prompt + j * decode_steps // decode_samples) % decode_steps for j in range(decode_samples)})


def calibrate(out: str | Path, prompts: list[Prompt], decode_steps: int = 8, max_bytes: int | None = None,
              decode_samples: int | None = 1) -> dict:
    """Run every prompt, store each NPU partition's inputs; returns the manifest's `calibration` entry
    (and, not recorded there, `seconds`). `decode_samples`: decode calls stored per prompt (None: all)."""
    out = Path(out)
    if decode_steps < 0:
        raise InputError(f"--decode-steps {decode_steps}: must be >= 0")
    if decode_samples is not None and decode_samples < 0:
        raise InputError(f"--decode-samples {decode_samples}: must be >= 0")
    manifest = load_manifest(out)
    generator = Generator(out)
    if not npu_partitions(manifest):
        raise InputError(f"{out}/manifest.json: no NPU partition to calibrate")
    for prompt in prompts:
        check_vocab(prompt, generator.vocab)  # before anything is written, naming the prompt's line
    expected = plan(manifest, prompts, generator.prefill[0].tokens, decode_steps, decode_samples)
    _announce(manifest, prompts, expected, decode_steps, decode_samples)
    if max_bytes is not None and expected.bytes > max_bytes:
        raise InputError(f"calibration needs {size_text(expected.bytes)} ({expected.bytes} bytes), more than "
                         f"--max-bytes {max_bytes}; use fewer prompts (--samples) or --decode-samples")
    _warn_thin(prompts, expected)
    recorder = Recorder(decode_steps, decode_samples, max_bytes)
    reopen_as_partitions(generator)
    use_partitions(generator, manifest, partition_sessions(
        out, manifest, recorder.tap, lambda graph, part: generator.sessions.get(out / part["path"])))
    with staged(out / FOLDER, overwrite=True, foreign=_foreign,
                remedy="calibrate only replaces the samples it wrote; move the file elsewhere") as stage, \
            Progress("calibrate", total=len(prompts), unit="prompt") as progress:
        recorder.root = stage
        for k, prompt in enumerate(prompts):
            recorder.start(k)
            try:
                generator.generate(prompt.ids, decode_steps + 1)
            except InputError as exc:
                raise InputError(f"{prompt.where}: {exc}") from None
            progress.advance()
        index = {"prompts": [{"ids": p.ids, **({"text": p.text} if p.text is not None else {})} for p in prompts],
                 "decode_steps": decode_steps, "decode_samples": decode_samples, "float32_as": FLOAT32_AS,
                 "samples": recorder.index}
        _write(stage / "index.json", dumps(index))
        _write(stage / "ranges.json", dumps(recorder.ranges()))
        seconds = progress.elapsed
    entry = {"path": FOLDER, "index": f"{FOLDER}/index.json", "ranges": f"{FOLDER}/ranges.json",
             "prompts": len(prompts), "decode_steps": decode_steps, "decode_samples": decode_samples,
             "float32_as": FLOAT32_AS, "bytes": recorder.bytes, "samples": recorder.counts()}
    manifest["calibration"] = entry
    save_manifest(out, manifest)
    log.info("mtkc: calibrated %d prompt(s) in %.1f s (%.2f prompts/s): %d samples, %s in %s",
             len(prompts), seconds, len(prompts) / max(seconds, 1e-9), len(recorder.index), size_text(recorder.bytes),
             out / FOLDER)
    return {**entry, "seconds": round(seconds, 1)}


def reopen_as_partitions(generator: Generator) -> None:
    """Release the whole-graph sessions and their weight mappings; `generator.sessions` becomes a
    fresh `Sessions` for the partitions (one private copy of the weights for all of them, read once)."""
    for stage in generator.prefill + generator.decode:
        stage.session = None
    generator.sessions = Sessions(generator.root, resident=True)


def _announce(manifest: dict, prompts: list[Prompt], expected: Plan, decode_steps: int, decode_samples: int | None) -> None:
    per_sample = {folder_name(g, p): sample_bytes(p) for g, p in npu_partitions(manifest)}
    log.info("mtkc: calibration: %d prompt(s) -> %s; %s on disk", len(prompts),
             ", ".join(f"{k}: {n} samples x {size_text(per_sample[k])}" for k, n in expected.samples.items()),
             size_text(expected.bytes))
    stored = len(stored_steps(0, decode_steps, decode_samples))
    if decode_steps:
        log.info("mtkc: calibration: --decode-steps %d runs %d decode call(s) per prompt, all in ranges.json; "
                 "%d stored per prompt (--decode-samples)", decode_steps, decode_steps, stored)


def save_manifest(out: Path, manifest: dict) -> None:
    """Replace OUT/manifest.json in one rename (readers see the old or the new file)."""
    replace_file(Path(out) / "manifest.json", dumps(manifest))


class Recorder:
    """The partition tap: writes the NPU partitions' inputs it is to store, and keeps every call's ranges."""

    def __init__(self, decode_steps: int = 0, decode_samples: int | None = None, max_bytes: int | None = None):
        self.root: Path | None = None
        self.decode_steps, self.decode_samples, self.max_bytes = decode_steps, decode_samples, max_bytes
        self.index: list[dict] = []
        self.prompt = 0
        self.keep: set[int] = set()
        self.steps: dict[str, int] = {}
        self.stats: dict[str, dict[str, Running]] = {}
        self.numbers: dict[str, int] = {}  # samples written per folder
        self.bytes = 0

    def start(self, prompt: int) -> None:
        self.prompt, self.steps = prompt, {}
        self.keep = set(stored_steps(prompt, self.decode_steps, self.decode_samples))

    def tap(self, graph: dict, part: dict, inputs: dict[str, np.ndarray], outputs: dict) -> None:
        if part["target"] != "npu":
            return
        name = folder_name(graph, part)
        step = self.steps.get(graph["name"], 0)
        self.steps[graph["name"]] = step + 1
        stats = self.stats.setdefault(name, {})
        for key, value in inputs.items():
            stats.setdefault(key, Running()).add(value)
        if graph["name"].startswith("decode") and step not in self.keep:
            return
        number = self.numbers.get(name, 0)
        self.numbers[name] = number + 1
        (self.root / name).mkdir(exist_ok=True)
        file = f"{number:04d}.npz"
        self.bytes += save_npz(self.root / name / file, {i["name"]: stored(inputs[i["name"]]) for i in part["inputs"]})
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            raise InputError(f"calibration samples passed --max-bytes {self.max_bytes} at prompt {self.prompt + 1}; "
                             "use fewer prompts (--samples) or --decode-samples")
        self.index.append({"dir": name, "file": file, "prompt": self.prompt, "graph": graph["name"], "step": step})

    def counts(self) -> dict[str, int]:
        return dict(sorted(self.numbers.items()))

    def ranges(self) -> dict:
        """{folder: {tensor: {min, max, absmax, p0.1 ... p99.9}}}: exact min/max, percentiles from the histogram."""
        result = {}
        for name, tensors in sorted(self.stats.items()):
            result[name] = {}
            for key, s in sorted(tensors.items()):
                entry = {"min": s.min, "max": s.max, "absmax": max(abs(s.min), abs(s.max))}
                entry.update((f"p{q:g}", v) for q, v in zip(PERCENTILES, s.percentiles(PERCENTILES)))
                result[name][key] = entry
        return result


class Running:
    """One tensor's values over every call in bounded memory: exact min/max, and a histogram of a
    strided subsample over log2|x| bins (BINS_PER_OCTAVE per octave, both signs, one bin for ~0),
    so a percentile is off by at most half a bin: 2^(1/64) - 1, about 1.1 % of its value."""

    BINS_PER_OCTAVE = 32
    OCTAVES = (-40, 40)  # |x| below 2^-40 counts as 0; above 2^40 falls in the last bin

    def __init__(self):
        self.min, self.max = math.inf, -math.inf
        self.side = (self.OCTAVES[1] - self.OCTAVES[0]) * self.BINS_PER_OCTAVE
        self.counts = np.zeros(2 * self.side + 1, np.int64)

    def add(self, value: np.ndarray) -> None:
        flat = np.asarray(value).ravel()
        low, high = (flat.min(), flat.max()) if flat.size else (0, 0)
        if not np.isfinite(float(low) + float(high)):  # NaN or inf: ranges over the finite values
            flat = flat[np.isfinite(flat)]
            low, high = (flat.min(), flat.max()) if flat.size else (0, 0)
        if not flat.size:
            return
        self.min, self.max = min(self.min, float(low)), max(self.max, float(high))
        sub = flat[:: max(1, flat.size // SUBSAMPLE)].astype(np.float64)
        magnitude = np.abs(sub)
        with np.errstate(divide="ignore"):
            level = np.floor((np.log2(np.maximum(magnitude, 2.0 ** (self.OCTAVES[0] - 1))) - self.OCTAVES[0])
                             * self.BINS_PER_OCTAVE)
        level = np.clip(level, -1, self.side - 1).astype(np.int64)
        bins = np.where(level < 0, self.side, np.where(sub > 0, self.side + 1 + level, self.side - 1 - level))
        self.counts += np.bincount(bins, minlength=self.counts.size)

    def percentiles(self, qs) -> list[float]:
        cumulative = np.cumsum(self.counts)
        result = []
        for q in qs:
            k = int(np.searchsorted(cumulative, q / 100 * cumulative[-1], side="left"))
            result.append(float(min(max(self._centre(k), self.min), self.max)))
        return result

    def _centre(self, k: int) -> float:
        if k == self.side:
            return 0.0
        level = k - self.side - 1 if k > self.side else self.side - 1 - k
        magnitude = 2.0 ** (self.OCTAVES[0] + (level + 0.5) / self.BINS_PER_OCTAVE)
        return magnitude if k > self.side else -magnitude


def stored(value: np.ndarray) -> np.ndarray:
    """How a sample array is stored: float32 as float16 when every value fits, anything else as is."""
    value = np.asarray(value)
    if value.dtype == np.float32 and value.size and -FLOAT16_MAX <= value.min() and value.max() <= FLOAT16_MAX:
        return value.astype(np.float16)
    return value


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> int:
    """`np.savez` with fixed zip timestamps (same arrays -> same bytes); returns the file's size."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_TIME)
            with archive.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arrays[key]), allow_pickle=False)
    return path.stat().st_size


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


def sample_bytes(part: dict) -> int:
    """Upper bound of one stored sample's file size (float32 counted as its float16 storage, plus
    each array's npy and zip headers)."""
    total = 0
    for spec in part["inputs"]:
        dtype = np.dtype(spec["dtype"])
        size = int(np.prod(spec["shape"] or [1])) * (2 if dtype == np.float32 else dtype.itemsize)
        total += size + _HEADERS + 2 * len(f"{spec['name']}.npy".encode())  # the name: local and central entry
    return total + _HEADERS


def size_text(n: int) -> str:
    """Bytes as MiB or GiB."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _foreign(folder: Path) -> str | None:
    """Why `folder` is not a calibration set mtkc wrote (then it is never replaced), or None."""
    if any(folder.iterdir()) and not (folder / "index.json").is_file():
        return "no index.json"
    return foreign_file(folder, calibration_files(folder))
