"""A calibration set read back from OUT as untrusted data (convert --quant, verify --quant).

    manifest `calibration`  an object; `path` "calibration", `index` "calibration/index.json",
                            `ranges` "calibration/ranges.json": the names `mtkc calibrate` writes
    OUT/calibration/        a real folder inside OUT (no symlink anywhere on the way)
      <graph>.<partition>/  one per NPU partition; its *.npz are regular files, not links
        NNNN.npz            a zip of `<input>.npy`, exactly the partition's inputs, each of its
                            shape and dtype (float16 accepted for a float32 input: cast back),
                            finite; headers read before any data, never unpickled
      index.json            {"prompts": [{"ids": [...]}, ...], ...}

Anything else is an InputError naming the file (exit 2), before a sample reaches onnxruntime or
the converter. mtkc does not read ranges.json back (the converter and the simulation calibrate
from the samples).
"""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

import numpy as np

from mtkc.ir.outdir import MANIFEST, read_json
from mtkc.errors import InputError

FOLDER = "calibration"
ENTRY = {"path": FOLDER, "index": f"{FOLDER}/index.json", "ranges": f"{FOLDER}/ranges.json"}
MAX_INDEX = 256 << 20  # bytes
MAX_ID = 2**31 - 1


def folder_name(graph: dict, part: dict) -> str:
    return f"{graph['name']}.{part['id']}"


def entry(out: str | os.PathLike, manifest: dict) -> dict:
    """The manifest's `calibration` entry, checked; its folder a real folder inside OUT."""
    found = manifest.get("calibration")
    where = f"{Path(out) / MANIFEST}: calibration"
    if not found:
        raise InputError(f"{Path(out) / MANIFEST}: no calibration; run `mtkc calibrate {out} --prompts FILE` first")
    if not isinstance(found, dict):
        raise InputError(f"{where}: expected an object")
    for key, expected in ENTRY.items():
        value = found.get(key, expected if key == "ranges" else None)
        if not isinstance(value, str):
            raise InputError(f"{where}.{key}: expected the string '{expected}', not {type(value).__name__}")
        if value != expected:
            raise InputError(f"{where}.{key}: '{value}' is not '{expected}' (the only path mtkc calibrate writes)")
    _real_folder(Path(out), FOLDER)
    return found


def sample_files(out: str | os.PathLike, manifest: dict, folder: str) -> list[Path]:
    """The sample files of one NPU partition folder, in order: regular files inside OUT."""
    entry(out, manifest)
    root = _real_folder(Path(out), f"{FOLDER}/{folder}", missing="no calibration samples for this partition")
    files = []
    for path in sorted(root.iterdir()):
        if path.suffix != ".npz":
            continue
        mode = path.lstat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise InputError(f"{path}: calibration sample is {kind}")
        files.append(path)
    if not files:
        raise InputError(f"{root}: no calibration samples for this partition")
    return files


def read_sample(path: Path, inputs: list[dict]) -> dict[str, np.ndarray]:
    """One sample, checked against the partition's inputs (`[{"name", "dtype", "shape"}]`)."""
    specs = {spec["name"]: spec for spec in inputs}
    try:
        with zipfile.ZipFile(path) as archive:
            members = {name[:-4]: name for name in archive.namelist() if name.endswith(".npy")}
            if set(members) != set(specs) or len(members) != len(archive.namelist()):
                missing, extra = sorted(set(specs) - set(members)), sorted(set(archive.namelist()) - set(members.values()))
                extra += sorted(set(members) - set(specs))
                raise InputError(f"{path}: calibration sample holds {sorted(members)}, expected the partition's inputs "
                                 f"{sorted(specs)}" + (f" (missing {missing})" if missing else "")
                                 + (f" (unexpected {extra})" if extra else ""))
            return {name: _array(archive, members[name], specs[name], path) for name in specs}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError):
        raise InputError(f"{path}: calibration sample is not an .npz archive") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the calibration sample ({exc.strerror or exc})") from None


def check_samples(files: list[Path], inputs: list[dict]) -> None:
    """Every sample of a partition readable and of the partition's inputs (one in memory at a time)."""
    for path in files:
        read_sample(path, inputs)


def index_prompts(out: str | os.PathLike, manifest: dict) -> list[list[int]]:
    """The prompts `mtkc calibrate` ran, from its index.json."""
    path = Path(out) / entry(out, manifest)["index"]
    if path.is_symlink() or not path.is_file():
        raise InputError(f"{path}: the calibration index is missing or not a regular file")
    index = read_json(path, MAX_INDEX, "cannot read the calibration index")
    prompts = index.get("prompts") if isinstance(index, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise InputError(f"{path}: prompts: expected a non-empty list")
    result = []
    for k, prompt in enumerate(prompts):
        ids = prompt.get("ids") if isinstance(prompt, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(x) is int and 0 <= x <= MAX_ID for x in ids):
            raise InputError(f"{path}: prompts[{k}].ids: expected a non-empty list of integers in 0..2^31-1")
        result.append(ids)
    return result


def _array(archive: zipfile.ZipFile, member: str, spec: dict, path: Path) -> np.ndarray:
    where = f"{path}: input '{spec['name']}'"
    fmt = np.lib.format
    try:
        with archive.open(member) as f:  # the header first: shape and dtype before any data is read
            version = fmt.read_magic(f)
            header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
            if header is None:
                raise InputError(f"{where}: .npy format version {version[0]}.{version[1]} (mtkc writes 1.0)")
            shape, _, dtype = header(f)
        if dtype.hasobject:
            raise InputError(f"{where}: holds Python objects (a pickle); refused")
        want = np.dtype(spec["dtype"]) if spec.get("dtype") else dtype
        if dtype != want and not (want == np.float32 and dtype == np.float16):
            raise InputError(f"{where}: dtype {dtype}, expected {want}")
        if spec.get("shape") is not None and list(shape) != list(spec["shape"]):
            raise InputError(f"{where}: shape {list(shape)}, expected {spec['shape']}")
        with archive.open(member) as f:
            value = fmt.read_array(f, allow_pickle=False)
    except (ValueError, TypeError, EOFError) as exc:
        raise InputError(f"{where}: not a plain .npy array ({(str(exc).splitlines() or [''])[0][:120]})") from None
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise InputError(f"{where}: holds NaN or Inf")
    return value.astype(np.float32) if value.dtype != want else value


def _real_folder(out: Path, relative: str, missing: str = "missing") -> Path:
    """OUT/relative when every step of it is a real folder (no symlink) inside OUT."""
    path = out
    for part in relative.split("/"):
        path = path / part
        if path.is_symlink():
            raise InputError(f"{path}: is a symlink; calibration data is read only from inside {out}")
    if not path.is_dir():
        raise InputError(f"{path}: {'not a folder' if path.exists() else missing}")
    return path
