"""`mtkc ops --sdk VER [--op NAME]`: the capability table's entries, constraints and provenance."""

from __future__ import annotations

import json
import sys

from mtkc.commands import options
from mtkc.errors import InputError
from mtkc.target import capability


def add_parser(sub) -> None:
    p = sub.add_parser("ops", description=__doc__)
    options.add_target(p)
    p.add_argument("--op", metavar="NAME", help="one op type (or DOMAIN:OP)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    options.add_common(p)
    p.set_defaults(func=run)


def select(table: capability.Table, op: str | None) -> list[capability.Entry]:
    entries = [table.entries[k] for k in sorted(table.entries)]
    if op is None:
        return entries
    domain, _, name = op.rpartition(":")
    found = [e for e in entries if e.op_type.lower() == name.lower() and (not domain or e.domain == domain)]
    if not found:
        raise InputError(f"op '{op}' is not in the NeuroPilot {table.version} table "
                         f"(see `mtkc ops --sdk {table.version}`)")
    return found


def run(args) -> int:
    table = capability.load_table(args.sdk, args.arch)
    entries = select(table, args.op)
    if args.format == "json":
        used = sorted({s for e in entries for s in e.sources})
        print(json.dumps({"sdk": table.version, "arch": table.arch, "defaults": dict(table.defaults),
                          "notes": list(table.notes), "entries": [e.to_dict() for e in entries],
                          "sources": {s: table.sources[s] for s in used}}, indent=2))
        return 0
    out = [f"NeuroPilot {table.version} / {table.arch}: {len(entries)} entries",
           "defaults    " + _constraints(table.defaults, {})]
    out += [f"  note      {n}" for n in table.notes]
    if not args.op:  # one line per entry: constraints beyond the defaults
        rows = [("op", "status", "provenance", "sources", "constraints / remedy")]
        for e in entries:
            extra = _constraints(e.constraints, table.defaults) if e.supported else f"remedy: {_remedy(e)}"
            rows.append((f"{e.domain}:{e.op_type}", "npu" if e.supported else "not-npu", e.provenance,
                         ",".join(e.sources) or "-", extra))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        out.append("")
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4] for r in rows]
    for e in entries if args.op else ():
        status = "npu" if e.supported else "not on NPU"
        out.append(f"\n{e.domain}:{e.op_type}  [{status}]  {e.provenance} ({', '.join(e.sources) or '-'})")
        if e.lowers_to:
            out.append(f"  lowers to     {e.lowers_to}")
        for kind, value in e.constraints.items():
            out.append(f"  {kind:<13} {value}")
        if e.note:
            out.append(f"  note          {e.note}")
        if e.remedy:
            out.append(f"  remedy        {_remedy(e)}")
    if args.op:
        out.append("")
        out += [f"[{s}] {table.sources[s]}" for s in sorted({s for e in entries for s in e.sources})]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _constraints(constraints, defaults) -> str:
    return " ".join(f"{k}={v}" for k, v in constraints.items() if defaults.get(k) != v) or "-"


def _remedy(e: capability.Entry) -> str:
    if not e.remedy:
        return "CPU fallback"
    return ", ".join(e.remedy.passes) + (f" ({e.remedy.hint})" if e.remedy.hint else "")
