"""What a pass may ask of the target: the capability-table protocol, and a null table for unit tests.

`mtkc.target.capability.Table` is the real implementation (one per NeuroPilot SDK). Passes see
only this protocol, so a pass unit test can run without an SDK: `NullTable` runs every standard
ONNX op (the `onnx.defs` schemas) at any shape and knows no vendor op (com.microsoft contribs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import onnx
import onnx_graphsurgeon as gs

ReadValues = Callable[[gs.Constant], Any]


class NodeVerdict(Protocol):
    supported: bool
    target: str  # "npu" | "cpu" | "host"
    reason: str | None
    detail: str | None


@runtime_checkable
class CapabilityTable(Protocol):
    version: str
    arch: str

    def has_op(self, domain: str, op_type: str) -> bool:
        """The op has an NPU entry (its constraints may still refuse a node)."""

    def supports(self, node: gs.Node, opset: int | None = None, read_values: ReadValues | None = None) -> bool:
        """The node runs on the NPU as it is."""

    def verdict(self, node: gs.Node, opset: int | None = None, read_values: ReadValues | None = None) -> NodeVerdict:
        """Where the node runs, and why not on the NPU."""


@dataclass(frozen=True)
class NullVerdict:
    supported: bool
    target: str
    reason: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class NullTable:
    """Every standard ONNX op is supported on the NPU; nothing else is."""

    version: str = "null"
    arch: str = "null"

    def has_op(self, domain: str, op_type: str) -> bool:
        return onnx.defs.has(op_type, "" if domain in ("", "ai.onnx") else domain)

    def supports(self, node: gs.Node, opset: int | None = None, read_values: ReadValues | None = None) -> bool:
        return self.has_op(node.domain or "", node.op)

    def verdict(self, node: gs.Node, opset: int | None = None, read_values: ReadValues | None = None) -> NodeVerdict:
        if self.supports(node):
            return NullVerdict(True, "npu")
        return NullVerdict(False, "cpu", "op-not-in-table", f"{node.op} is not a standard ONNX op")
