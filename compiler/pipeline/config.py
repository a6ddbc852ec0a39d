"""Project configuration: `mtkc.toml`, or `[tool.mtkc]` in `pyproject.toml`.

Looked up in the current directory unless `--config FILE` names one. Keys mirror the CLI
options (`sdk`, `arch`, `passes`, `skip_passes`, `plugins`, `seq_len`, `cache_len`, `batch`,
`input_shapes`, `verify_each`, `kv_cache`, `cache_io`, `chunks`) and a `[pass_options]` table whose keys go to the passes as
they are (e.g. `kv_cache = true`); an option given on the command line replaces the config
value (lists are replaced, not merged). Plugin files are relative to the config file.

    # mtkc.toml
    sdk = "8"
    seq_len = 128
    skip_passes = ["rank4"]
    plugins = ["my_passes.py"]
    [input_shapes]
    input_ids = [1, 128]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib

from mtkc.errors import InputError

KEYS: dict[str, str] = {
    "sdk": "str",
    "arch": "str",
    "passes": "list",
    "skip_passes": "list",
    "plugins": "list",
    "seq_len": "int",
    "cache_len": "int",
    "batch": "int",
    "input_shapes": "shapes",
    "verify_each": "bool",
    "kv_cache": "bool",
    "cache_io": "str",
    "chunks": "int",
    "pass_options": "table",
}


def load_config(path: str | Path | None = None, cwd: str | Path = ".") -> dict[str, Any]:
    """The config as a dict of known keys ({} when there is none)."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such config file")
        return _read(path, in_pyproject=path.name == "pyproject.toml")
    cwd = Path(cwd)
    if (cwd / "mtkc.toml").is_file():
        return _read(cwd / "mtkc.toml", in_pyproject=False)
    if (cwd / "pyproject.toml").is_file():
        return _read(cwd / "pyproject.toml", in_pyproject=True)
    return {}


def merge(config: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """Config values overridden by every CLI value that was given (not None, not empty)."""
    merged = dict(config)
    for key, value in cli.items():
        if value is not None and value != [] and value != {}:
            merged[key] = value
        else:
            merged.setdefault(key, value)
    return merged


def _read(path: Path, in_pyproject: bool) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise InputError(f"{path}: not a readable TOML file ({exc})") from None
    if in_pyproject:
        data = data.get("tool", {}).get("mtkc", {})
    where = f"{path}" + (" [tool.mtkc]" if in_pyproject else "")
    config = {}
    for key, value in data.items():
        kind = KEYS.get(key)
        if kind is None:
            raise InputError(f"{where}: unknown key '{key}'; known keys: {', '.join(KEYS)}")
        config[key] = _typed(where, key, kind, value)
    config.update(config.pop("pass_options", {}))
    if "plugins" in config:
        config["plugins"] = [_relative_to(path.parent, p) for p in config["plugins"]]
    return config


def _typed(where: str, key: str, kind: str, value: Any) -> Any:
    ok = {
        "str": lambda v: isinstance(v, (str, int)) and not isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "bool": lambda v: isinstance(v, bool),
        "table": lambda v: isinstance(v, dict) and not set(v) & set(KEYS),
        "list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "shapes": lambda v: isinstance(v, dict)
        and all(isinstance(d, list) and all(isinstance(x, int) for x in d) for d in v.values()),
    }[kind]
    if not ok(value):
        expected = {
            "str": "a string",
            "int": "a positive integer",
            "bool": "true or false",
            "table": "a table of pass options (not named like a top-level key)",
            "list": "a list of strings",
            "shapes": "a table of input name = [dims]",
        }[kind]
        raise InputError(f"{where}: '{key}' must be {expected}, got {value!r}")
    if kind == "str":
        return str(value)
    if kind == "shapes":
        return {name: tuple(dims) for name, dims in value.items()}
    return value


def _relative_to(folder: Path, plugin: str) -> str:
    """A plugin file path relative to the config's folder (modules and EP names unchanged)."""
    if plugin.endswith(".py") and not Path(plugin).is_absolute():
        candidate = folder / plugin
        if folder != Path(".") and candidate.is_file():
            return str(candidate)
    return plugin


def from_args(args) -> dict[str, Any]:
    """Config (from `--config` or the current directory) overridden by the CLI options given."""
    from mtkc.commands.options import parse_input_shapes, split_names

    cli = {
        "sdk": getattr(args, "sdk", None),
        "arch": getattr(args, "arch", None),
        "seq_len": getattr(args, "seq_len", None),
        "cache_len": getattr(args, "cache_len", None),
        "batch": getattr(args, "batch", None),
        "input_shapes": parse_input_shapes(getattr(args, "input_shape", None) or []),
        "passes": split_names(getattr(args, "passes", None)),
        "skip_passes": list(getattr(args, "skip_pass", None) or []),
        "plugins": list(getattr(args, "plugin", None) or []),
        "verify_each": getattr(args, "verify_each", None),
        "kv_cache": getattr(args, "kv_cache", None),
        "cache_io": getattr(args, "cache_io", None),
        "chunks": getattr(args, "chunks", None),
    }
    return merge(load_config(getattr(args, "config", None)), cli)
