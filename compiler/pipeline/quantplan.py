"""Mixed precision: which scheme each quantised unit (decoder layer i, the LM head) runs at.

    unit      "layer i" = `layer_of` (exporter node names `layers.<i>/`), the LM head = "lm_head"
    Precision(scheme, {unit: scheme | None}, alone=False)
              every NPU node at `scheme` except the named units; None: the unit stays float.
              alone=True: only the named units are quantised (per-unit sensitivity).
    plan file quant-plan.json: {"scheme": base, "units": {"3": "A16W8", "lm_head": "A16W16"}, ...}

Raising a unit is only to a scheme MediaTek's converter takes per output channel (`RAISE`): weights
8 or 16 bits, activations 16 bits; never block-wise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from mtkc.errors import InputError

SCHEMES = {"A16W16": (16, 16), "A16W8": (16, 8), "A16W4": (16, 4), "A8W8": (8, 8), "A8W4": (8, 4)}
LAYER = re.compile(r"layers[./](\d+)[./]")
LM_HEAD = "lm_head"
RAISE = ("A16W8", "A16W16")  # what a unit may be raised to, in order
PLAN_FILE = "quant-plan.json"


def layer_of(node: onnx.NodeProto) -> int | None:
    """"Layer i" of a node (the one numbering `--keep-fp`, plans and sensitivity use)."""
    m = LAYER.search(node.name)
    return int(m[1]) if m else None


def unit_of(node: onnx.NodeProto, logits: str = "logits"):
    """The node's unit: its decoder layer (int), "lm_head" for the LM head's MatMul/Gemm, else None."""
    layer = layer_of(node)
    if layer is not None:
        return layer
    if node.op_type in ("MatMul", "Gemm") and ("lm_head" in node.name or logits in node.output):
        return LM_HEAD
    return None


def parse_units(text: str | None, what: str = "--keep-fp") -> list:
    """`0,3,lm_head` -> [0, 3, 'lm_head'] (layers sorted, the LM head last)."""
    if not text:
        return []
    units, head = set(), False
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == LM_HEAD:
            head = True
            continue
        try:
            units.add(int(item))
        except ValueError:
            raise InputError(f"{what} '{text}': expected comma-separated layer numbers or lm_head, e.g. 0,3,lm_head") from None
    if any(x < 0 for x in units):
        raise InputError(f"{what} '{text}': layer numbers are >= 0")
    return sorted(units) + ([LM_HEAD] if head else [])


def unit_key(unit) -> str:
    return str(unit)


def unit_from_key(key: str):
    return LM_HEAD if key == LM_HEAD else int(key)


@dataclass(frozen=True)
class Precision:
    """The scheme of every NPU node: `units` override the base `scheme` (None: float)."""

    scheme: str
    units: dict = field(default_factory=dict)
    alone: bool = False  # only the named units are quantised

    def of(self, node: onnx.NodeProto):
        unit = unit_of(node)
        if unit in self.units:
            return self.units[unit]
        return None if self.alone else self.scheme

    def key(self) -> str:
        named = ",".join(f"{u}={s}" for u, s in sorted(self.units.items(), key=lambda x: str(x[0])))
        return f"{self.scheme}{'-alone' if self.alone else ''}-{named}"

    @staticmethod
    def keep(scheme: str, units) -> Precision:
        """`--keep-fp`: the named units at 16-bit weights and activations."""
        return Precision(scheme, {u: "A16W16" for u in units})


def raised(scheme: str) -> list[str]:
    """Schemes a unit of `scheme` may be raised to, lowest first: more weight or activation bits, never fewer."""
    a, w = SCHEMES[scheme]
    return [s for s in RAISE if SCHEMES[s][0] >= a and SCHEMES[s][1] >= w and s != scheme]


def write_plan(path: Path, scheme: str, units: dict, summary: dict) -> None:
    data = {"scheme": scheme, "units": {unit_key(u): s for u, s in units.items()}, **summary}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_plan(path: str | Path) -> tuple[str, dict]:
    """(base scheme, {unit: scheme}) of a quant-plan.json; a malformed file is an InputError naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read the plan ({exc})") from None
    known = SCHEMES
    if not isinstance(data, dict) or data.get("scheme") not in known or not isinstance(data.get("units", {}), dict):
        raise InputError(f"{path}: expected {{\"scheme\": one of {', '.join(known)}, \"units\": {{layer: scheme}}}}")
    units = {}
    for key, value in data.get("units", {}).items():
        try:
            unit = unit_from_key(key)
        except ValueError:
            raise InputError(f"{path}: unit '{key}': expected a layer number or lm_head") from None
        if value not in known or (isinstance(unit, int) and unit < 0):
            raise InputError(f"{path}: unit '{key}': scheme '{value}', expected one of {', '.join(known)}")
        units[unit] = value
    return data["scheme"], units
