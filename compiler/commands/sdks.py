"""`mtkc sdks`: the NeuroPilot SDK versions with a capability table, their MDLA archs and lineage."""

from __future__ import annotations

import json
import sys

from mtkc.commands import options
from mtkc.target import capability


def add_parser(sub) -> None:
    p = sub.add_parser("sdks", description=__doc__)
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    options.add_common(p)
    p.set_defaults(func=run)


def describe() -> list[dict]:
    out = []
    for version in capability.available_sdks():
        t = capability.load_table(version)
        out.append({
            "sdk": t.version, "description": t.description, "archs": list(t.archs),
            "default_arch": t.default_arch, "extends": t.extends[0] if t.extends else None,
            "npu_ops": sum(e.supported for e in t.entries.values()), "entries": len(t.entries),
        })
    return out


def run(args) -> int:
    rows = describe()
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    table = [("sdk", "archs", "default", "extends", "npu ops", "description")]
    table += [(r["sdk"], ",".join(r["archs"]), r["default_arch"], r["extends"] or "-", str(r["npu_ops"]),
               r["description"]) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5] + "\n")
    return 0
