"""Loading capability tables: TOML files `opsets/neuropilot-<ver>.toml`, validated, `extends` resolved.

Unknown keys, bad values or unknown source ids are load errors naming the file and key (InputError).
"""

from __future__ import annotations

import functools
import importlib.resources
import re

import tomllib

from mtkc.errors import InputError
from mtkc.options import normalize_sdk
from mtkc.target.model import (
    CONSTRAINTS,
    DEFAULT_CONSTRAINTS,
    DTYPES,
    ENTRY_META,
    PROVENANCE,
    REASONS,
    Entry,
    Remedy,
    Table,
    version_key,
)

FILE_RE = re.compile(r"^neuropilot-(\d+(?:\.\d+)*)\.toml$")


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
        return sorted(self._files, key=version_key)

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
