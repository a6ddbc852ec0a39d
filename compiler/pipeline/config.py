"""Project configuration: `mtkc.toml`, or `[tool.mtkc]` in `pyproject.toml`.

Looked up in the current directory unless `--config FILE` names one. Keys are the option names
of `mtkc.options.Options` (the CLI flags with `_`: `sdk`, `seq_len`, `skip_passes`, `plugins`,
`rope_mode`, `force_cpu`, ...) and `[pass_options.<pass name>]` tables for plugin passes. The
file gives raw values; `mtkc.options.build` validates them exactly as it validates the CLI's,
naming `FILE:key` in errors. An option given on the command line replaces the config value
(lists are replaced, not merged). Plugin files are relative to the config file.

    # mtkc.toml
    sdk = "8"
    seq_len = 128
    skip_passes = ["rank4"]
    plugins = ["my_passes.py"]
    [input_shapes]
    input_ids = [1, 128]
    [pass_options.drop-dropout]
    keep_training_mode = false
"""

from __future__ import annotations

from pathlib import Path

import tomllib

from mtkc.errors import InputError
from mtkc.options import USER_KEYS, Layer

KEYS = tuple(k for k in USER_KEYS if k != "overwrite")  # replacing a folder is asked for on the command line


def load_config(path: str | Path | None = None, cwd: str | Path = ".") -> Layer | None:
    """The config file's raw values (None when there is none); unknown keys are an error."""
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise InputError(f"{path}: is a directory, not a config file")
        if not path.is_file():
            raise InputError(f"{path}: no such config file")
        return _read(path, in_pyproject=path.name == "pyproject.toml")
    cwd = Path(cwd)
    if (cwd / "mtkc.toml").is_file():
        return _read(cwd / "mtkc.toml", in_pyproject=False)
    if (cwd / "pyproject.toml").is_file():
        return _read(cwd / "pyproject.toml", in_pyproject=True)
    return None


def _read(path: Path, in_pyproject: bool) -> Layer | None:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (ValueError, OSError) as exc:  # TOMLDecodeError, or bytes that are not UTF-8
        raise InputError(f"{path}: not a readable TOML file ({str(exc).splitlines()[0] if str(exc) else exc})") from None
    if in_pyproject:
        data = data.get("tool", {}).get("mtkc")
        if not isinstance(data, dict):
            return None
    where = f"{path}" + (" [tool.mtkc]" if in_pyproject else "")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key '{unknown[0]}'; known keys: {', '.join(KEYS)}")
    plugins = data.get("plugins")
    if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):
        data["plugins"] = [_relative_to(path.parent, p) for p in plugins]
    return Layer(data, where)


def _relative_to(folder: Path, plugin: str) -> str:
    """A plugin file path relative to the config's folder (modules and EP names unchanged)."""
    if plugin.endswith(".py") and not Path(plugin).is_absolute():
        candidate = folder / plugin
        if folder != Path(".") and candidate.is_file():
            return str(candidate)
    return plugin
