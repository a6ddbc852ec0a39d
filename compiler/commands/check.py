"""`mtkc check MODEL --sdk VER`: which nodes the NPU of SDK VER accepts, and what to do about the rest."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtkc.backend.staging import replace_file
from mtkc.commands import options
from mtkc.commands.partitioning import add_placement
from mtkc.display import escape
from mtkc.pipeline.check import CheckReport, check

EXAMPLES = 3  # example node names per row in the text table


def add_parser(sub) -> None:
    p = sub.add_parser("check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model.onnx (external data next to it)")
    options.add_target(p, required=False)  # from the config, else one error line (as compile)
    options.add_shapes(p)
    options.add_pipeline(p)
    options.add_llm(p)
    add_placement(p)
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    p.add_argument("--strict", action="store_true", help="exit 1 when compile would leave any node on the CPU")
    p.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    options.add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    opts = options.with_sdk(options.from_args(args))  # config (--config or ./mtkc.toml) overridden by the CLI, as in compile
    report = check(args.model, opts.sdk, opts)
    text = json.dumps(report.to_json(), indent=2) + "\n" if args.format == "json" else render(report)
    if args.output:
        replace_file(Path(args.output), text)
        print(f"mtkc: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 1 if args.strict and report.cpu_fallback else 0


def render(report: CheckReport) -> str:
    a = report.assessment
    compiled = "n/a" if report.coverage_compiled is None else f"{report.coverage_compiled:.1%}"
    lines = [
        f"model       {escape(report.model)}",
        f"target      NeuroPilot {report.sdk} / {report.arch}",
        f"verdict     {report.verdict} after compile's pipeline (GOOD: largest NPU partition > 75% of nodes, "
        "MAYBE: > 50%, else POOR)",
        f"partitions  {report.partitions}; largest NPU partition {report.largest_partition} nodes; "
        f"--strict {'fails (nodes on the CPU)' if report.cpu_fallback else 'passes'}",
    ]
    for g in report.graphs:
        lines.append(f"  {g.name:<9} {g.nodes} nodes, {g.cpu_nodes} on CPU, {g.npu_partitions} NPU / "
                     f"{g.partitions - g.npu_partitions} CPU partitions")
    if report.bound:
        lines.append("compile     binds " + ", ".join(f"{k}={v}" for k, v in report.bound.items())
                     + " (MediaTek's LLM defaults for dims left open)")
    for key, why in report.picked.items():
        lines.append(f"compile     picks {key}={why}")
    for item in report.on_cpu[:EXAMPLES * 3]:
        lines.append(f"on CPU      {escape(item['graph'])}: {escape(item['node'])} ({escape(item['reason'])})")
    if len(report.on_cpu) > EXAMPLES * 3:
        lines.append(f"on CPU      ... {len(report.on_cpu) - EXAMPLES * 3} more (--format json lists all)")
    for key, better in report.suggested.items():
        lines.append(f"remedy      --{key.replace('_', '-')} {better}")
    lines += [
        f"nodes       {a.nodes} ({a.constants} Constant nodes not counted)",
        f"NPU         {a.supported} nodes; coverage {a.coverage:.1%} raw, {compiled} after passes",
    ]
    q = report.quantization
    if q and q["state"] != "float":
        lines.append(f"quantized   {q['state']}: {q['quantize_linear']} QuantizeLinear, {q['dequantize_linear']} DequantizeLinear "
                     f"({q['per_channel']} per-channel; weights {', '.join(q['weight_dtypes']) or 'none'})"
                     + "".join(f", {n} {op}" for op, n in {**q.get("dynamic", {}), **q.get("qoperator", {})}.items()))
    if report.decoder is not None:
        lines.append(f"decoder     {escape(report.decoder.summary())}")
    if report.unbound:
        lines.append(f"unbound     {escape(', '.join(report.unbound))} (bind with --seq-len/--cache-len/--batch/--input-shape)")
    if a.groups:
        rows = [("op", "domain", "count", "reason", "detail", "remedy", "example nodes")]
        for g in a.groups:
            examples = ", ".join(g.nodes[:EXAMPLES]) + (", ..." if g.count > EXAMPLES else "")
            rows.append(tuple(escape(c) for c in (g.op, g.domain, str(g.count), g.reason, g.verdict.detail or "",
                                                  report.remedy(g), examples)))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines.append("")
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[6])
    return "\n".join(lines) + "\n"

