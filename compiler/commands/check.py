"""`mtkc check MODEL --sdk VER`: which nodes the NPU of SDK VER accepts, and what to do about the rest."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from mtkc.commands import options
from mtkc.pipeline.check import CheckReport, check
from mtkc.target.capability import remedy_text

EXAMPLES = 3  # example node names per row in the text table


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="NPU coverage of a model for one SDK (writes nothing)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model.onnx (external data next to it)")
    options.add_target(p)
    options.add_shapes(p)
    options.add_pipeline(p)
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any node is not NPU-supported")
    p.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    options.add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mtkc.pipeline.config import KEYS, from_args

    opts = from_args(args)  # config (--config or ./mtkc.toml) overridden by the CLI, as in compile
    pipeline = {k: v for k, v in opts.items() if k in ("passes", "skip_passes", "plugins") or k not in KEYS}
    report = check(args.model, opts["sdk"], arch=opts["arch"], seq_len=opts["seq_len"], cache_len=opts["cache_len"],
                   batch=opts["batch"], input_shapes=opts["input_shapes"], pipeline=pipeline)
    text = json.dumps(report.to_json(), indent=2) + "\n" if args.format == "json" else render(report)
    if args.output:
        _write_atomic(Path(args.output), text)
        print(f"mtkc: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.strict and report.assessment.supported < report.assessment.nodes:
        return 1
    return 0


def render(report: CheckReport) -> str:
    a = report.assessment
    compiled = "n/a" if report.coverage_compiled is None else f"{report.coverage_compiled:.1%}"
    lines = [
        f"model       {report.model}",
        f"target      NeuroPilot {report.sdk} / {report.arch}",
        f"nodes       {a.nodes} ({a.constants} Constant nodes not counted)",
        f"NPU         {a.supported} nodes; coverage {a.coverage:.1%} raw, {compiled} after passes",
        f"partitions  {a.partitions} (estimate: runs of NPU nodes in topological order; "
        f"largest {max(a.partition_sizes, default=0)})",
        f"verdict     {report.verdict} (GOOD: largest partition > 75% of nodes, MAYBE: > 50%, else POOR)",
    ]
    q = report.quantization
    if q and q["state"] != "float":
        lines.append(f"quantized   {q['state']}: {q['quantize_linear']} QuantizeLinear, {q['dequantize_linear']} DequantizeLinear "
                     f"({q['per_channel']} per-channel; weights {', '.join(q['weight_dtypes']) or 'none'})"
                     + "".join(f", {n} {op}" for op, n in {**q.get("dynamic", {}), **q.get("qoperator", {})}.items()))
    if report.unbound:
        lines.append(f"unbound     {', '.join(report.unbound)} (bind with --seq-len/--cache-len/--batch/--input-shape)")
    if a.groups:
        rows = [("op", "domain", "count", "reason", "remedy", "example nodes")]
        for g in a.groups:
            examples = ", ".join(g.nodes[:EXAMPLES]) + (", ..." if g.count > EXAMPLES else "")
            v = g.verdict  # the table shows passes/SDK; the hint is in --format json
            remedy = remedy_text(v.passes, v.first_sdk) if v.passes or v.first_sdk else v.remedy
            rows.append((g.op, g.domain, str(g.count), g.reason, remedy, examples))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines.append("")
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
