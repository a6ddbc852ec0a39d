"""The capability-table model: entries, verdicts, and a table that judges one node.

A node's verdict is the first failing constraint predicate (`mtkc.target.predicates`), in their
order; the remedy comes from the table's data (entry or reason remedies) and the first later SDK
whose table accepts the node. Tables are built by `mtkc.target.loader`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.opset import NPU_OPSET, no_opset17_form
from mtkc.target.predicates import CHECKS, DEFAULT_DOMAIN
from mtkc.target.remedies import remedy_text

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
ENTRY_META = ("supported", "lowers_to", "provenance", "sources", "note", "remedy")


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
    known_passes: frozenset[str] | None = field(default=None, compare=False, repr=False)

    @property
    def remedy(self) -> str | None:
        """'pass rope; --sdk 8.0; <hint>', or 'CPU fallback' when nothing helps."""
        return None if self.supported else remedy_text(self.passes, self.first_sdk, self.hint, self.known_passes)


SUPPORTED = Verdict(True, "npu")



@functools.lru_cache(maxsize=None)
def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


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
    catalog: Any = field(repr=False, compare=False)  # the loader.Catalog it came from (for later SDKs)
    known_passes: frozenset[str] | None = field(default=None, repr=False, compare=False)
    """registered pass names, set by a caller that has the registry: remedies mark others '(planned)'"""

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
            known_passes=self.known_passes,
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
            if version_key(version) > version_key(self.version):
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
        for check in CHECKS:
            failure = check(node, c, opset, read_values)
            if failure:
                return failure
        newer = no_opset17_form(node)  # what the table accepts must still be writable at opset 17
        if newer:
            return "no-opset17-form", f"{newer}; NPU partitions are opset {NPU_OPSET}", None
        return None
