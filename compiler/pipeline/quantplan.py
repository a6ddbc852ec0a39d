"""Mixed precision: which scheme each quantised unit (decoder layer i, the LM head) runs at.

    unit      "layer i": the nodes compile recorded as layer i (manifest `graphs[].decoder`, found by
              structure: `mtkc.analysis.regions`; i as in `past_key_<i>`, `--chunks`, `check`), the LM
              head = "lm_head" (the map's logits MatMul); `Units` reads and checks the record
    Precision(scheme, {unit: scheme | None}, alone=False)
              every NPU node at `scheme` except the named units; None: the unit stays float.
              alone=True: only the named units are quantised (per-unit sensitivity).
    plan file quant-plan.json: {"scheme": base, "units": {"3": "A16W8", "lm_head": "A16W16"}, ...}

Raising a unit is only to a scheme MediaTek's converter takes per output channel (`RAISE`): weights
8 or 16 bits, activations 16 bits; never block-wise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtkc.errors import InputError
from mtkc.ir.outdir import MANIFEST

SCHEMES = {"A16W16": (16, 16), "A16W8": (16, 8), "A16W4": (16, 4), "A8W8": (8, 8), "A8W4": (8, 4)}
LM_HEAD = "lm_head"
RAISE = ("A16W8", "A16W16")  # what a unit may be raised to, in order
PLAN_FILE = "quant-plan.json"
MAX_LAYERS = 1 << 16


class Units:
    """The quantisation units an OUT's manifest records per graph (`graphs[].decoder`), checked as the
    untrusted content it is: indices unique ints in range, every node named once and in one of the
    graph's partitions. A graph without the record (an older compile) is an InputError: recompile
    (falling back to node names would number another export's layers wrongly, or none, silently)."""

    def __init__(self, out: Path, manifest: dict):
        self.nodes: dict[str, dict[str, object]] = {}  # graph -> node name -> unit
        self.outputs: dict[str, dict[int, str]] = {}  # graph -> layer -> the tensor leaving it
        for g, graph in enumerate(manifest["graphs"]):
            where = f"{Path(out) / MANIFEST}: graphs[{g}].decoder"
            entry = graph.get("decoder")
            if entry is None:
                raise InputError(f"{where}: missing (compiled by an mtkc without decoder layer records): "
                                 "compile the model again")
            nodes, outputs = self._read(entry, graph, where)
            self.nodes[graph["name"]], self.outputs[graph["name"]] = nodes, outputs

    @staticmethod
    def _read(entry, graph: dict, where: str) -> tuple[dict, dict]:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise InputError(f"{where}: {what}")

        need(isinstance(entry, dict) and isinstance(entry.get("layers"), list), 'expected {"layers": [...], "lm_head"}')
        known = set()
        for part in graph["partitions"]:
            names = part.get("nodes")
            need(isinstance(names, list) and all(isinstance(n, str) for n in names),
                 f"partition '{part['id']}' has no list of node names")
            known.update(names)
        nodes, outputs = {}, {}

        def claim(name, unit) -> None:
            need(isinstance(name, str) and name in known, f"unit {unit}: node {str(name)[:80]!r} is in none of the "
                                                          "graph's partitions")
            need(name not in nodes, f"node {name[:80]!r} is in units {nodes.get(name)} and {unit}")
            nodes[name] = unit

        for layer in entry["layers"]:
            need(isinstance(layer, dict), "layers: expected objects")
            index = layer.get("index")
            need(type(index) is int and 0 <= index < MAX_LAYERS, f"layer index {str(index)[:40]!r}: expected 0..{MAX_LAYERS - 1}")
            need(index not in outputs, f"layer {index} listed twice")
            need(layer.get("output") is None or isinstance(layer["output"], str), f"layer {index}: output not a string")
            need(isinstance(layer.get("nodes"), list), f"layer {index}: nodes not a list")
            for name in layer["nodes"]:
                claim(name, index)
            outputs[index] = layer.get("output")
        head = entry.get("lm_head")
        if head is not None:
            claim(head, LM_HEAD)
        return nodes, {i: t for i, t in sorted(outputs.items()) if t is not None}

    def of(self, graph: str, node: str):
        """The unit of node `node` of graph `graph`: a layer index, LM_HEAD, or None."""
        return self.nodes.get(graph, {}).get(node)


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

    def of(self, unit):
        """The scheme of a node of `unit` (None: float)."""
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
