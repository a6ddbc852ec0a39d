"""Capability tables: what each NeuroPilot SDK's NPU accepts, and a verdict per ONNX node.

A table is a TOML file `opsets/neuropilot-<ver>.toml` (read with importlib.resources). It names
its MDLA archs, its sources, table-wide defaults, and one entry per (domain, op type) built from a
fixed vocabulary of constraint kinds, each an executable predicate:

    host            {input, const_rows_over}: a lookup in a big table host-op (target "host")
    max_rank        rank of every input and output                    rank-unsupported
    dtypes          allowed dtypes of every input and output        dtype-unsupported
    input_dtypes    {"<index>": [...]}: overrides `dtypes` for one input
    const_dtypes    also accepted on constant inputs (int64 shapes/axes: the converter casts
                    them to int32, so their values must fit; read only when <= 1024 elements)
    static_shapes   every input/output dim is a known integer         shape-dynamic
    const_inputs    these input indices must be constants             input-not-constant
    attributes      {name: [allowed values]}; [] = must be absent     attribute-unsupported
    last_axis       this attribute (or `axes` input) is the last axis attribute-unsupported
    broadcast       "equal-rank": activation inputs share one rank    broadcast-unsupported

A node's verdict is the first failing check, in this order (a lookup that moves to the host is
not judged further; constants of lower rank may broadcast, the converter expands them).

An entry with `supported = false` documents an op that never runs on the NPU (op-unsupported);
an op without an entry is op-not-in-table; a domain no entry uses is unknown-domain. A table may
`extends` an older one (entries replace whole entries); its `archs` may replace entries for one
MDLA arch. Unknown keys, bad values or unknown source ids are load errors naming file and key.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import logging
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import tomllib

from mtkc.errors import InputError
from mtkc.target.onnx_opset import NPU_OPSET, no_opset17_form

log = logging.getLogger("mtkc")

PROVENANCE = ("documented", "mtk-llm-graphs", "inferred")
REASONS = (
    "unknown-domain",
    "op-not-in-table",
    "op-unsupported",
    "host-op",
    "dtype-unsupported",
    "rank-unsupported",
    "shape-dynamic",
    "input-not-constant",
    "attribute-unsupported",
    "broadcast-unsupported",
    "no-opset17-form",
)
OP_REASONS = ("unknown-domain", "op-not-in-table", "op-unsupported")
DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "string",
)
CONSTRAINTS = ("dtypes", "input_dtypes", "const_dtypes", "max_rank", "static_shapes", "attributes",
               "last_axis", "const_inputs", "broadcast", "host")
DEFAULT_CONSTRAINTS = ("dtypes", "const_dtypes", "max_rank", "static_shapes")
CAST_LIMIT = 1024  # elements of a constant whose values are read to check they fit int32
ENTRY_META = ("supported", "lowers_to", "provenance", "sources", "note", "remedy")
DEFAULT_DOMAIN = "ai.onnx"
FILE_RE = re.compile(r"^neuropilot-(\d+(?:\.\d+)*)\.toml$")


@dataclass(frozen=True)
class Remedy:
    passes: tuple[str, ...] = ()
    hint: str | None = None


@dataclass(frozen=True)
class Entry:
    """One (domain, op type) of a table; `constraints` already include the table defaults."""

    domain: str
    op_type: str
    supported: bool
    provenance: str
    sources: tuple[str, ...]
    constraints: Mapping[str, Any] = field(default_factory=dict)
    lowers_to: str | None = None
    note: str | None = None
    remedy: Remedy | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op_type, "domain": self.domain, "supported": self.supported}
        if self.lowers_to:
            out["lowers_to"] = self.lowers_to
        if self.supported:
            out["constraints"] = dict(self.constraints)
        out["provenance"] = self.provenance
        out["sources"] = list(self.sources)
        if self.note:
            out["note"] = self.note
        if self.remedy:
            out["remedy"] = {"passes": list(self.remedy.passes), "hint": self.remedy.hint}
        return out


@dataclass(frozen=True)
class Verdict:
    """Where a node can run. `reason` is one of REASONS (None when supported)."""

    supported: bool
    target: str  # "npu" | "cpu" | "host"
    reason: str | None = None
    detail: str | None = None
    passes: tuple[str, ...] = ()  # rewrite passes that address the reason
    first_sdk: str | None = None  # first later SDK whose table accepts the node
    hint: str | None = None

    @property
    def remedy(self) -> str | None:
        """'pass rope; --sdk 8.0; <hint>', or 'CPU fallback' when nothing helps."""
        return None if self.supported else remedy_text(self.passes, self.first_sdk, self.hint)


SUPPORTED = Verdict(True, "npu")


# ---- loading -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def normalize_sdk(sdk: str) -> str:
    """'6', 'np6', 'v6.0', 'neuropilot-6.0' -> '6.0'."""
    text = str(sdk).strip().lower()
    for prefix in ("neuropilot-", "neuropilot", "np", "v"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return f"{text}.0" if text.isdigit() else text


class Catalog:
    """The table files of one folder (the package's `opsets/` by default), parsed once each."""

    def __init__(self, root=None):
        self.root = root if root is not None else importlib.resources.files("mtkc.opsets")
        self._files = {}
        for item in self.root.iterdir():
            m = FILE_RE.match(item.name)
            if m:
                self._files[m.group(1)] = item
        self._specs: dict[str, dict] = {}
        self._tables: dict[tuple[str, str | None], Table] = {}

    def versions(self) -> list[str]:
        return sorted(self._files, key=_version_key)

    def load(self, sdk: str, arch: str | None = None) -> Table:
        version = normalize_sdk(sdk)
        if version not in self._files:
            raise InputError(f"unknown SDK '{sdk}'; available: {', '.join(self.versions()) or 'none'}")
        key = (version, arch)
        if key not in self._tables:
            self._tables[key] = self._build(version, arch)
        return self._tables[key]

    def _spec(self, version: str, seen: tuple[str, ...] = ()) -> dict:
        """The merged (extends-resolved) spec of one version."""
        if version in seen:
            raise InputError(f"{self._files[seen[0]].name}: sdk.extends: cycle {' -> '.join(seen + (version,))}")
        if version not in self._specs:
            own = _parse(self._files[version], version)
            parent = own["sdk"].get("extends")
            if parent is not None:
                parent = normalize_sdk(parent)
                if parent not in self._files:
                    raise InputError(f"{self._files[version].name}: sdk.extends: unknown SDK '{parent}'")
                own = _merge(self._spec(parent, seen + (version,)), own)
            _check_sources(own, self._files[version].name)
            self._specs[version] = own
        return self._specs[version]

    def _build(self, version: str, arch: str | None) -> Table:
        spec = self._spec(version)
        archs = spec["archs"]
        arch = arch or spec["sdk"]["default_arch"]
        if arch not in archs:
            raise InputError(f"unknown arch '{arch}' for SDK {version}; available: {', '.join(sorted(archs))}")
        raw_ops = dict(spec["ops"])
        raw_ops.update(archs[arch].get("ops", {}))
        defaults = {k: v for k, v in spec["defaults"].items() if k in DEFAULT_CONSTRAINTS}
        entries = {key: _entry(key, raw, defaults) for key, raw in raw_ops.items()}
        return Table(
            version=version,
            arch=arch,
            archs={name: a.get("description", "") for name, a in sorted(archs.items())},
            default_arch=spec["sdk"]["default_arch"],
            extends=spec["sdk"].get("extends_chain", ()),
            description=spec["sdk"].get("description", ""),
            sources=dict(spec["sources"]),
            notes=tuple(spec["defaults"].get("notes", ())),
            defaults=defaults,
            entries=entries,
            remedies={k: _remedy(v) for k, v in spec["remedies"].items()},
            converter=dict(spec["converter"]),
            catalog=self,
        )


def _parse(item, version: str) -> dict:
    """Read and validate one file (without its parent)."""
    name = item.name
    try:
        data = tomllib.loads(item.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{name}: malformed TOML: {exc}") from None
    v = _Validator(name)
    v.keys(data, "", {"sdk", "archs", "sources", "defaults", "remedies", "converter", "ops"})
    sdk = v.table(data.get("sdk"), "sdk", required=True)
    v.keys(sdk, "sdk", {"version", "extends", "description", "default_arch"})
    if sdk.get("version") != version:
        v.fail("sdk.version", f"must be '{version}' (the file name's version)")
    for key in ("extends", "description", "default_arch"):
        v.string(sdk.get(key), f"sdk.{key}", required=key == "default_arch")
    archs = v.table(data.get("archs"), "archs", required=True)
    if sdk["default_arch"] not in archs:
        v.fail("sdk.default_arch", f"'{sdk['default_arch']}' is not one of [archs]")
    for arch, body in archs.items():
        v.table(body, f"archs.{arch}")
        v.keys(body, f"archs.{arch}", {"description", "sources", "ops"})
        v.string(body.get("description"), f"archs.{arch}.description")
        v.strings(body.get("sources"), f"archs.{arch}.sources")
        body["ops"] = _parse_ops(v, body.get("ops"), f"archs.{arch}.ops")
    sources = v.table(data.get("sources"), "sources")
    for sid, text in sources.items():
        v.string(text, f"sources.{sid}", required=True)
    defaults = v.table(data.get("defaults"), "defaults")
    v.keys(defaults, "defaults", set(DEFAULT_CONSTRAINTS) | {"sources", "notes"})
    _check_constraints(v, {k: x for k, x in defaults.items() if k in DEFAULT_CONSTRAINTS}, "defaults")
    v.strings(defaults.get("sources"), "defaults.sources")
    v.strings(defaults.get("notes"), "defaults.notes")
    remedies = v.table(data.get("remedies"), "remedies")
    for key, body in remedies.items():
        if key.partition(":")[0] not in REASONS:
            v.fail(f"remedies.{key}", f"unknown reason; expected one of {', '.join(REASONS)}")
        _check_remedy(v, body, f"remedies.{key}")
    converter = v.table(data.get("converter"), "converter")
    for key, text in converter.items():
        v.string(text, f"converter.{key}", required=True)
    return {
        "sdk": sdk, "archs": archs, "sources": sources, "defaults": defaults, "remedies": remedies,
        "converter": converter, "ops": _parse_ops(v, data.get("ops"), "ops"), "file": name,
    }


def _parse_ops(v: _Validator, ops, where: str) -> dict[tuple[str, str], dict]:
    out = {}
    for domain, by_op in v.table(ops, where).items():
        for op_type, body in v.table(by_op, f"{where}.{domain}").items():
            key = f"{where}.{domain}.{op_type}"
            v.table(body, key)
            v.keys(body, key, set(CONSTRAINTS) | set(ENTRY_META))
            supported = body.get("supported", True)
            if not isinstance(supported, bool):
                v.fail(f"{key}.supported", "must be true or false")
            if body.get("provenance") not in PROVENANCE:
                v.fail(f"{key}.provenance", f"must be one of {', '.join(PROVENANCE)}")
            v.strings(body.get("sources"), f"{key}.sources")
            v.string(body.get("note"), f"{key}.note")
            v.string(body.get("lowers_to"), f"{key}.lowers_to")
            if "remedy" in body:
                _check_remedy(v, body["remedy"], f"{key}.remedy")
            constraints = {k: x for k, x in body.items() if k in CONSTRAINTS}
            if not supported and constraints:
                v.fail(f"{key}.{next(iter(constraints))}", "constraints on an unsupported entry")
            _check_constraints(v, constraints, key)
            out[(domain, op_type)] = body
    return out


def _check_constraints(v: _Validator, constraints: dict, where: str) -> None:
    for kind, value in constraints.items():
        key = f"{where}.{kind}"
        if kind in ("dtypes", "const_dtypes"):
            v.dtypes(value, key)
        elif kind == "input_dtypes":
            for index, dts in v.table(value, key).items():
                if not index.isdigit():
                    v.fail(f"{key}.{index}", "input index must be a non-negative integer")
                v.dtypes(dts, f"{key}.{index}")
        elif kind == "max_rank":
            v.integer(value, key)
        elif kind == "static_shapes":
            if not isinstance(value, bool):
                v.fail(key, "must be true or false")
        elif kind == "attributes":
            for name, allowed in v.table(value, key).items():
                if not isinstance(allowed, list):
                    v.fail(f"{key}.{name}", "must be a list of allowed values ([] = must be absent)")
        elif kind == "last_axis":
            v.string(value, key, required=True)
        elif kind == "const_inputs":
            if not isinstance(value, list):
                v.fail(key, "must be a list of input indices")
            for i in value:
                v.integer(i, key)
        elif kind == "broadcast":
            if value not in ("equal-rank", "any"):
                v.fail(key, "must be 'equal-rank' or 'any'")
        elif kind == "host":
            v.keys(v.table(value, key), key, {"input", "const_rows_over"})
            v.integer(value.get("input"), f"{key}.input")
            v.integer(value.get("const_rows_over"), f"{key}.const_rows_over")


def _check_remedy(v: _Validator, body, key: str) -> None:
    v.keys(v.table(body, key), key, {"passes", "hint"})
    v.strings(body.get("passes"), f"{key}.passes")
    v.string(body.get("hint"), f"{key}.hint")


class _Validator:
    """Load errors name the file and the dotted key."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, key: str, message: str):
        raise InputError(f"{self.file}: {key}: {message}")

    def keys(self, body: dict, where: str, allowed: set[str]) -> None:
        for key in body:
            if key not in allowed:
                self.fail(f"{where}.{key}" if where else key, f"unknown key; expected one of {', '.join(sorted(allowed))}")

    def table(self, value, key: str, required: bool = False) -> dict:
        if value is None and not required:
            return {}
        if not isinstance(value, dict):
            self.fail(key, "must be a table")
        return value

    def string(self, value, key: str, required: bool = False) -> None:
        if (value is None and required) or (value is not None and not isinstance(value, str)):
            self.fail(key, "must be a string")

    def strings(self, value, key: str) -> None:
        if value is not None and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            self.fail(key, "must be a list of strings")

    def integer(self, value, key: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(key, "must be a non-negative integer")

    def dtypes(self, value, key: str) -> None:
        self.strings(value, key)
        for dt in value or ():
            if dt not in DTYPES:
                self.fail(key, f"unknown dtype '{dt}'; expected one of {', '.join(DTYPES)}")


def _merge(parent: dict, child: dict) -> dict:
    """Child over parent: sections merge key by key; an op entry replaces the parent's whole entry."""
    merged = {
        "sdk": dict(child["sdk"], extends_chain=(normalize_sdk(child["sdk"]["extends"]),)
                    + parent["sdk"].get("extends_chain", ())),
        "archs": child["archs"],  # hardware is per SDK: never inherited
        "file": child["file"],
    }
    for section in ("sources", "defaults", "remedies", "converter", "ops"):
        merged[section] = {**parent[section], **child[section]}
    return merged


def _check_sources(spec: dict, file: str) -> None:
    known = spec["sources"]
    places = [("defaults", spec["defaults"])]
    places += [(f"ops.{d}.{o}", body) for (d, o), body in spec["ops"].items()]
    for arch, body in spec["archs"].items():
        places.append((f"archs.{arch}", body))
        places += [(f"archs.{arch}.ops.{d}.{o}", b) for (d, o), b in body["ops"].items()]
    for where, body in places:
        for sid in body.get("sources", ()):
            if sid not in known:
                raise InputError(f"{file}: {where}.sources: unknown source id '{sid}'")


def _entry(key: tuple[str, str], raw: dict, defaults: dict) -> Entry:
    supported = raw.get("supported", True)
    constraints = {**defaults, **{k: v for k, v in raw.items() if k in CONSTRAINTS}} if supported else {}
    return Entry(
        domain=key[0], op_type=key[1], supported=supported, provenance=raw["provenance"],
        sources=tuple(raw.get("sources", ())), constraints=constraints,
        lowers_to=raw.get("lowers_to"), note=raw.get("note"),
        remedy=_remedy(raw["remedy"]) if "remedy" in raw else None,
    )


def _remedy(body: dict) -> Remedy:
    return Remedy(passes=tuple(body.get("passes", ())), hint=body.get("hint"))


@functools.lru_cache(maxsize=1)
def _default_catalog() -> Catalog:
    return Catalog()


def available_sdks() -> list[str]:
    """SDK versions with a table, oldest first."""
    return _default_catalog().versions()


def load_table(sdk: str, arch: str | None = None) -> Table:
    """The table of `sdk` for `arch` (default: the table's default arch). InputError when unknown."""
    return _default_catalog().load(sdk, arch)


# ---- verdicts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    version: str
    arch: str
    archs: Mapping[str, str]  # arch -> description
    default_arch: str
    extends: tuple[str, ...]  # parent, grandparent, ...
    description: str
    sources: Mapping[str, str]
    notes: tuple[str, ...]
    defaults: Mapping[str, Any]
    entries: Mapping[tuple[str, str], Entry]
    remedies: Mapping[str, Remedy]
    converter: Mapping[str, str]
    catalog: Catalog = field(repr=False, compare=False)

    @functools.cached_property
    def domains(self) -> frozenset[str]:
        return frozenset(d for d, _ in self.entries)

    def entry(self, domain: str, op_type: str) -> Entry | None:
        return self.entries.get((domain or DEFAULT_DOMAIN, op_type))

    def has_op(self, domain: str, op_type: str) -> bool:
        """True when the op has an NPU entry (its constraints may still refuse a node)."""
        e = self.entry(domain, op_type)
        return e is not None and e.supported

    def verdict(self, node: gs.Node, opset: int | None = None,
                read_values: Callable[[gs.Constant], np.ndarray] | None = None) -> Verdict:
        """Verdict of one node from its tensors' dtypes/shapes (infer them first when unknown).

        `opset` picks the ONNX schema for attribute defaults (latest when None); `read_values`
        reads a small constant's values (ReduceMean `axes`, int64 constants) from external data.
        """
        failure = self._evaluate(node, opset, read_values)
        if failure is None:
            return SUPPORTED
        reason, detail, qualifier = failure
        remedy = self._remedy_for(node, reason, qualifier)
        first_sdk = self._first_sdk(node, opset, read_values)
        return Verdict(
            supported=False,
            target="host" if reason == "host-op" else "cpu",
            reason=reason,
            detail=detail,
            passes=remedy.passes if remedy else (),
            first_sdk=first_sdk,
            hint=remedy.hint if remedy else None,
        )

    def supports(self, node: gs.Node, opset: int | None = None,
                 read_values: Callable[[gs.Constant], np.ndarray] | None = None) -> bool:
        """`verdict(...).supported`, without working out the remedy and first SDK."""
        return self._evaluate(node, opset, read_values) is None

    def _remedy_for(self, node: gs.Node, reason: str, qualifier: str | None) -> Remedy | None:
        if reason in OP_REASONS:
            e = self.entry(node.domain, node.op)
            return e.remedy if e else None
        return self.remedies.get(f"{reason}:{qualifier}") or self.remedies.get(reason)

    def _first_sdk(self, node, opset, read_values) -> str | None:
        for version in self.catalog.versions():
            if _version_key(version) > _version_key(self.version):
                if self.catalog.load(version)._evaluate(node, opset, read_values) is None:
                    return version
        return None

    def _evaluate(self, node: gs.Node, opset, read_values) -> tuple[str, str, str | None] | None:
        """None when supported, else (reason, detail, qualifier): the first failing check. The
        qualifier (offending dtype or attribute) picks a `<reason>:<qualifier>` remedy."""
        domain = node.domain or DEFAULT_DOMAIN
        if domain not in self.domains:
            return "unknown-domain", f"domain '{domain}' is not in the NeuroPilot {self.version} table", None
        e = self.entries.get((domain, node.op))
        if e is None:
            return "op-not-in-table", f"{node.op} is not in the NeuroPilot {self.version} table", None
        if not e.supported:
            return "op-unsupported", e.note or f"{node.op} does not run on the NPU", None
        c = e.constraints
        for check in _CHECKS:
            failure = check(node, c, opset, read_values)
            if failure:
                return failure
        newer = no_opset17_form(node)  # what the table accepts must still be writable at opset 17
        if newer:
            return "no-opset17-form", f"{newer}; NPU partitions are opset {NPU_OPSET}", None
        return None


def remedy_text(passes: tuple[str, ...], first_sdk: str | None, hint: str | None = None) -> str:
    """Passes (marked '(planned)' when not registered), the first SDK that accepts, the hint."""
    known = _registered_passes()
    parts = [f"pass {p}" + ("" if p in known else " (planned)") for p in passes]
    if first_sdk:
        parts.append(f"--sdk {first_sdk}")
    if hint:
        parts.append(hint)
    return "; ".join(parts) if parts else "CPU fallback"


@functools.lru_cache(maxsize=1)
def _registered_passes() -> frozenset[str]:
    """Names in the pass registry after importing the built-in pass modules (stand-in for the
    pass manager's loader: a module that fails to import is skipped, it is not our error)."""
    from mtkc.rewrite import pass_api

    try:
        package = importlib.import_module("mtkc.passes")
        for info in pkgutil.iter_modules(package.__path__):
            try:
                importlib.import_module(f"mtkc.passes.{info.name}")
            except Exception as exc:  # another module's bug must not break `check`
                log.debug("pass module %s not importable: %s", info.name, exc)
    except ImportError:
        pass
    return frozenset(pass_api.REGISTRY)


# ---- the constraint predicates (one per kind; order = report priority) -------------------------


def _dtype_name(tensor: gs.Tensor) -> str | None:
    dt = tensor.dtype
    if dt is None:
        return None
    try:
        enum = dt if isinstance(dt, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    except (TypeError, KeyError, ValueError):
        return str(dt)
    name = onnx.TensorProto.DataType.Name(enum).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def _shape(tensor: gs.Tensor):
    return None if tensor.shape is None else tuple(tensor.shape)


def _constant(tensor: gs.Tensor) -> gs.Constant | None:
    """The constant behind a tensor: an initializer or a Constant node's value."""
    if isinstance(tensor, gs.Constant):
        return tensor
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        value = tensor.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return value
    return None


def _tensors(node: gs.Node):
    """(label, tensor) for every present input and output."""
    for i, t in enumerate(node.inputs):
        if t.name:
            yield f"input {i} '{t.name}'", t, i
    for i, t in enumerate(node.outputs):
        yield f"output {i} '{t.name}'", t, None


def _host(node, c, opset, read_values):
    host = c.get("host")
    if not host or host["input"] >= len(node.inputs):
        return None
    const = _constant(node.inputs[host["input"]])
    if const is not None and const.shape and const.shape[0] > host["const_rows_over"]:
        return ("host-op", f"input {host['input']} '{node.inputs[host['input']].name}' is a constant table "
                f"of {const.shape[0]} rows (> {host['const_rows_over']}): a host lookup", None)
    return None


def _dtypes(node, c, opset, read_values):
    default = c.get("dtypes")
    per_input = c.get("input_dtypes", {})
    for label, t, index in _tensors(node):
        allowed = per_input.get(str(index), default) if index is not None else default
        name = _dtype_name(t)
        if allowed is None or name is None or name in allowed:
            continue
        const = _constant(t) if index is not None and name in c.get("const_dtypes", ()) else None
        if const is None:
            return "dtype-unsupported", f"{label} is {name}", name
        unfit = _int32_unfit(const, read_values)
        if unfit:
            return "dtype-unsupported", f"{label} is a {name} constant {unfit}", name
    return None


def _int32_unfit(const: gs.Constant, read_values) -> str | None:
    """Why the converter's cast of this constant to int32 would fail, or None."""
    size = int(np.prod(const.shape, dtype=np.int64))
    if size > CAST_LIMIT:
        return f"of {size} elements (not checked)"
    try:
        values = np.asarray((read_values or (lambda k: k.values))(const))
    except Exception:  # unreadable external data
        return "whose values could not be read"
    info = np.iinfo(np.int32)
    bad = values[(values < info.min) | (values > info.max)]
    return f"with values outside int32 ({bad.flat[0]})" if bad.size else None


def _rank(node, c, opset, read_values):
    limit = c.get("max_rank")
    if limit is None:
        return None
    for label, t, _ in _tensors(node):
        shape = _shape(t)
        if shape is not None and len(shape) > limit:
            return "rank-unsupported", f"{label} has rank {len(shape)} > {limit}", None
    return None


def _static(node, c, opset, read_values):
    if not c.get("static_shapes"):
        return None
    for label, t, _ in _tensors(node):
        shape = _shape(t)
        if shape is None:
            return "shape-dynamic", f"{label} has an unknown shape", None
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            return "shape-dynamic", f"{label} has shape [{', '.join(map(str, shape))}]", None
    return None


def _const_inputs(node, c, opset, read_values):
    for index in c.get("const_inputs", ()):
        if index < len(node.inputs) and node.inputs[index].name and _constant(node.inputs[index]) is None:
            return "input-not-constant", f"input {index} '{node.inputs[index].name}' is computed at run time", None
    return None


def _attributes(node, c, opset, read_values):
    for name, allowed in c.get("attributes", {}).items():
        present = name in node.attrs
        if not allowed:
            if present:
                return "attribute-unsupported", f"attribute {name} is not supported", name
            continue
        value = node.attrs[name] if present else _schema_default(node, name, opset)
        if value is not None and value not in allowed:
            return "attribute-unsupported", f"attribute {name}={value!r} not in {allowed}", name
    return None


def _last_axis(node, c, opset, read_values):
    name = c.get("last_axis")
    if not name:
        return None
    shape = _shape(node.inputs[0]) if node.inputs else None
    rank = len(shape) if shape is not None else None
    if name in node.attrs:
        axes = node.attrs[name]
    elif name == "axes" and len(node.inputs) > 1 and node.inputs[1].name:
        const = _constant(node.inputs[1])
        if const is None:
            return "input-not-constant", f"input 1 '{node.inputs[1].name}' (axes) is computed at run time", None
        try:
            axes = (read_values or (lambda k: k.values))(const)
        except Exception:  # unreadable external data: say so rather than guess
            return "attribute-unsupported", f"axes input '{node.inputs[1].name}' could not be read", name
    else:
        axes = _schema_default(node, name, opset)
    axes = None if axes is None else [int(a) for a in np.atleast_1d(np.asarray(axes))]
    if not axes:
        if rank == 1:
            return None
        return "attribute-unsupported", f"{name} unset: reduces over all axes, only the last axis is supported", name
    last = [-1] if rank is None else [-1, rank - 1]
    if len(axes) != 1 or axes[0] not in last:
        return "attribute-unsupported", f"{name}={axes} is not the last axis (rank {rank})", name
    return None


def _broadcast(node, c, opset, read_values):
    if c.get("broadcast") != "equal-rank":
        return None
    ranks = [(t.name, len(t.shape), _constant(t) is not None) for t in node.inputs
             if t.name and t.shape is not None]
    live = [r for _, r, const in ranks if not const]
    top = max(live, default=None)
    for name, r, const in ranks:
        if top is not None and (r > top or (not const and r != top)):
            other = next(n for n, rr, k in ranks if not k and rr == top)
            return ("broadcast-unsupported",
                    f"inputs '{name}' (rank {r}) and '{other}' (rank {top}) differ in rank", None)
    return None


_CHECKS = (_host, _rank, _dtypes, _static, _const_inputs, _attributes, _last_axis, _broadcast)


@functools.lru_cache(maxsize=None)
def _schema_attr_default(op: str, domain: str, name: str, opset: int | None):
    try:
        if opset is None:
            schema = onnx.defs.get_schema(op, domain="" if domain == DEFAULT_DOMAIN else domain)
        else:
            schema = onnx.defs.get_schema(op, opset, "" if domain == DEFAULT_DOMAIN else domain)
    except onnx.defs.SchemaError:
        return -1 if name == "axis" else None  # contrib ops (com.microsoft) default to the last axis
    attr = schema.attributes.get(name)
    if attr is None or not attr.default_value.name:
        return None
    value = onnx.helper.get_attribute_value(attr.default_value)
    return value.decode() if isinstance(value, bytes) else value


def _schema_default(node: gs.Node, name: str, opset: int | None):
    return _schema_attr_default(node.op, node.domain or DEFAULT_DOMAIN, name, opset)
