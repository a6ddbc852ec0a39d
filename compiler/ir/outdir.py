"""Reading an OUT folder back (verify, generate): its manifest's shape, and every path it names
confined to OUT.

OUT may have been edited by hand or by an attacker. A manifest of the wrong shape, a missing
key, a path that leaves OUT (`..`, absolute, a symlink pointing out), a graph whose weights
were truncated, or a pickled `.npy` is an InputError naming the file and the field: never a
crash, and no file outside OUT is ever opened (the source model, `model.path`, is the one path
the manifest may name outside OUT: it is the user's own input).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx

from mtkc.errors import InputError
from mtkc.ir.model_checks import validate_proto

MANIFEST = "manifest.json"
MAX_DIM = 2**31
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # graph and partition names: they become file names


def read_manifest(out: str | os.PathLike) -> dict:
    """OUT/manifest.json, parsed and checked (shape, required keys, every path confined to OUT)."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise InputError(f"{out}: no manifest.json (is it an mtkc compile output?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    _check_shape(data, path, out)
    return data


def read_json(path: Path, limit: int, what: str):
    """`path` parsed as JSON, refused (InputError naming `what`) past `limit` bytes or when unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise InputError(f"{path}: larger than {limit >> 20} MiB")
        return json.loads(data.decode("utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path}: {what} ({type(exc).__name__})") from None


def confined(out: str | os.PathLike, relative: object, what: str) -> Path:
    """`OUT/relative` when it is a relative path that stays inside OUT (symlinks resolved) and is a file."""
    if not isinstance(relative, str) or not relative:
        raise InputError(f"{Path(out) / MANIFEST}: {what}: path {relative!r} is not a relative file name")
    parts = relative.replace("\\", "/").split("/")
    if os.path.isabs(relative) or relative.startswith("\\") or ".." in parts or "\0" in relative:
        raise InputError(f"{Path(out) / MANIFEST}: {what}: path '{relative}' leaves the output folder")
    root = os.path.realpath(out)
    real = os.path.realpath(os.path.join(root, relative))
    if not real.startswith(root + os.sep):
        raise InputError(f"{Path(out) / MANIFEST}: {what}: path '{relative}' is a symlink leaving the output folder")
    if not os.path.isfile(real):
        raise InputError(f"{Path(out) / relative}: {what} listed in the manifest is missing")
    return Path(out) / relative


def check_graph_file(path: Path) -> onnx.ModelProto:
    """Structure of a graph file (no weight read) with every external-data reference checked:
    inside its folder, within the file (a truncated weights.bin is named here)."""

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # DecodeError and friends: not an ONNX file
        raise InputError(f"{path}: not a readable ONNX model ({type(exc).__name__})") from None
    validate_proto(proto, Path(path), Path(path).parent.resolve())
    return proto


def load_table(path: Path) -> np.ndarray:
    """A host table (`.npy`), memory-mapped; never unpickled."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(f"{path}: not a plain .npy array ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _check_shape(data, path: Path, out) -> None:
    def need(cond: bool, where: str, what: str) -> None:
        if not cond:
            raise InputError(f"{path}: {where}: {what}")

    need(isinstance(data, dict), "top level", "expected a JSON object")
    need(isinstance(data.get("schema_version"), int), "schema_version", "missing or not an integer")
    for key in ("sdk", "arch"):  # the SDK table is looked up by them
        need(data.get(key) is None or isinstance(data[key], str), key, "not a string")
    graphs = data.get("graphs")
    need(isinstance(graphs, list) and bool(graphs), "graphs", "missing, empty or not a list")
    for g, graph in enumerate(graphs):
        where = f"graphs[{g}]"
        need(isinstance(graph, dict), where, "expected an object")
        need(isinstance(graph.get("name"), str), f"{where}.name", "missing or not a string")
        need(bool(PLAIN_NAME.fullmatch(graph["name"])), f"{where}.name", f"not a plain name ({PLAIN_NAME.pattern})")
        confined(out, graph.get("path"), f"{where}.path")
        for key in ("inputs", "outputs"):
            _check_specs(graph.get(key), f"{where}.{key}", need)
        parts = graph.get("partitions")
        need(isinstance(parts, list), f"{where}.partitions", "missing or not a list")
        for p, part in enumerate(parts):
            pwhere = f"{where}.partitions[{p}]"
            need(isinstance(part, dict), pwhere, "expected an object")
            need(isinstance(part.get("id"), str), f"{pwhere}.id", "missing or not a string")
            need(bool(PLAIN_NAME.fullmatch(part["id"])), f"{pwhere}.id", f"not a plain name ({PLAIN_NAME.pattern})")
            need(part.get("target") in ("npu", "cpu"), f"{pwhere}.target", "expected 'npu' or 'cpu'")
            confined(out, part.get("path"), f"{pwhere}.path")
            for key in ("inputs", "outputs"):
                _check_specs(part.get(key), f"{pwhere}.{key}", need, wired=False)
    host = data.get("host", {})
    need(isinstance(host, dict), "host", "not an object")
    for name, entry in host.items():
        need(isinstance(entry, dict), f"host.{name}", "expected an object")
        confined(out, entry.get("path"), f"host.{name}.path")
    for key in ("options", "model"):
        need(isinstance(data.get(key, {}), dict), key, "not an object")


def _check_specs(specs, where: str, need, wired: bool = True) -> None:
    """`wired`: a graph's inputs (`from` = {"graph", "output"}); a partition's say `from` = its producer's id."""
    need(isinstance(specs, list), where, "missing or not a list")
    for k, spec in enumerate(specs):
        need(isinstance(spec, dict) and isinstance(spec.get("name"), str), f"{where}[{k}]", "expected {\"name\", ...}")
        need("shape" in spec, f"{where}[{k}].shape", "missing")  # readers index it (the hand-off's jobs)
        shape = spec.get("shape")
        need(shape is None or (isinstance(shape, list) and all(d is None or isinstance(d, str) or
                                                                (type(d) is int and 0 <= d < MAX_DIM) for d in shape)),
             f"{where}[{k}].shape", f"expected a list of dims (0 <= d < {MAX_DIM}, a name, or null) or null")
        source = spec.get("from")
        if wired:
            need(source is None or (isinstance(source, dict) and isinstance(source.get("graph"), str)
                                    and isinstance(source.get("output"), str)), f"{where}[{k}].from",
                 "expected {\"graph\", \"output\"}")
        else:
            need(source is None or isinstance(source, str), f"{where}[{k}].from", "expected a string")
