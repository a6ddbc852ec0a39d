"""What mtkc wrote in a folder: the files its own records list, nothing else.

`compile --overwrite` replaces OUT, and `calibrate` replaces OUT/calibration, only when every file
in it is one of these (directories hold nothing to lose); any other file (`logs/notes.txt`,
`calibration/my_prompts.jsonl`) or symlink is named and nothing is replaced.

    OUT          manifest.json, report.json, report.md, convert.sh, weights.bin, every path the
                 manifest names (graphs, partitions, host tables), <graph>.placement.json, and per
                 NPU partition K its converter files: logs/K.log, dla/K.{dla,tflite}, bisection probes
    calibration  index.json, ranges.json and every sample file index.json lists

Staging of mtkc's own (`.NAME.mtkc-PID-*`, this user's, PID gone: a process killed between write
and rename) is not the user's either: skipped here, and removed by the next run into its folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

CALIBRATION = "calibration"
FIXED = ("manifest.json", "report.json", "report.md", "convert.sh", "weights.bin",
         ".manifest.json.mtkc-tmp")  # the last: calibrate's temporary manifest before it carried a pid
STAGING = re.compile(r"\.(?P<name>.+)\.mtkc-(?P<pid>\d+)-.*", re.DOTALL)


def staging_prefix(target: Path) -> str:
    """Names of staging entries for `target`, in its folder: `.NAME.mtkc-` + pid + `-` ..."""
    return f".{target.name}.mtkc-"


def staging_pid(path: Path) -> int | None:
    """The pid in a staging entry's name when it is one of this user's, else None."""
    match = STAGING.fullmatch(path.name)
    if match is None:
        return None
    try:
        if path.lstat().st_uid != os.getuid():
            return None
    except OSError:
        return None
    return int(match["pid"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def stale(path: Path) -> bool:
    """A staging entry of this user's whose process is gone."""
    pid = staging_pid(path)
    return pid is not None and pid != os.getpid() and not alive(pid)


def out_files(out: Path, manifest: dict) -> set[str]:
    """Files of a compile's OUT mtkc wrote, relative to OUT, from its manifest (and calibration index)."""
    owned = set(FIXED) | _paths(manifest.get("graphs")) | _paths(manifest.get("host"))
    for graph in _list(manifest.get("graphs")):
        if not isinstance(graph, dict) or not isinstance(graph.get("name"), str):
            continue
        owned.add(f"{graph['name']}.placement.json")
        for part in _list(graph.get("partitions")):
            if isinstance(part, dict) and isinstance(part.get("id"), str):
                key = f"{graph['name']}.{part['id']}"
                owned |= {f"logs/{key}.log", f".bisect.{key}.onnx"}
                owned |= {f"dla/{key}{probe}.{ext}" for probe in ("", ".bisect") for ext in ("dla", "tflite")}
    owned |= {f"{CALIBRATION}/{name}" for name in calibration_files(Path(out) / CALIBRATION)}
    return owned


def calibration_files(folder: Path) -> set[str]:
    """Files of a calibration folder mtkc wrote, relative to it: its index, ranges and listed samples."""
    owned = {"index.json", "ranges.json"}
    index = Path(folder) / "index.json"
    try:
        if index.is_symlink() or not index.is_file():
            return owned
        samples = json.loads(index.read_text(encoding="utf-8")).get("samples")
    except (OSError, ValueError, AttributeError):
        return owned
    for sample in _list(samples):
        if isinstance(sample, dict) and isinstance(sample.get("dir"), str) and isinstance(sample.get("file"), str):
            owned.add(f"{sample['dir']}/{sample['file']}")
    return owned


def foreign_file(root: Path, owned: set[str]) -> str | None:
    """Why `root` holds something mtkc did not write (the first such entry), or None."""
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked folders
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            path = here / name
            entry = path.relative_to(root).as_posix()
            pid = staging_pid(path)
            if pid is not None and pid != os.getpid():
                if alive(pid):
                    return f"'{entry}' is being written by mtkc process {pid}"
                if name in dirnames:
                    dirnames.remove(name)  # a killed run's staging: not the user's
                continue
            if path.is_symlink() or (name in filenames and entry not in owned):
                return f"holds '{entry}'"
        dirnames.sort()
    return None


def _paths(item) -> set[str]:
    """Every `path` string in a manifest section, at any depth."""
    found: set[str] = set()
    stack = [item]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("path"), str):
                found.add(item["path"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _list(value) -> list:
    return value if isinstance(value, list) else []
