"""`mtkc check MODEL --sdk VER`: which nodes the NPU of SDK VER accepts, and what to do about the rest."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
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
    p.add_argument("-j", "--jobs", type=_jobs, metavar="N",
                   help="1, or 2 to judge the input and build decode beside prefill in forked processes "
                        "(Linux; default: 2 for a graph of 5000 nodes or more on 2+ CPUs); the report is the same")
    options.add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    opts = options.with_sdk(options.from_args(args))  # config (--config or ./mtkc.toml) overridden by the CLI, as in compile
    report = check(args.model, opts.sdk, opts, jobs=args.jobs)
    width = shutil.get_terminal_size().columns if not args.output and sys.stdout.isatty() else None
    text = json.dumps(report.to_json(), indent=2) + "\n" if args.format == "json" else render(report, width)
    if args.output:
        replace_file(Path(args.output), text)
        print(f"mtkc: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 1 if args.strict and report.cpu_fallback else 0


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{escape(text)}'")
    return int(text)


def render(report: CheckReport, width: int | None = None) -> str:
    """The report as text; its table wrapped to `width` columns (a terminal's) when given."""
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
        lines += [f"            {escape(line)}" for line in report.decoder.per_layer()]
    if report.unbound:
        lines.append(f"unbound     {escape(', '.join(report.unbound))} (bind with --seq-len/--cache-len/--batch/--input-shape)")
    if a.groups:
        rows = [("op", "domain", "count", "reason", "detail", "remedy", "example nodes")]
        for g in a.groups:
            examples = ", ".join(g.nodes[:EXAMPLES]) + (", ..." if g.count > EXAMPLES else "")
            hint = g.verdict.hint if g.reason != "shape-dynamic" else None  # the remedy says it
            detail = "; ".join(t for t in (g.verdict.detail, hint) if t)
            rows.append(tuple(escape(c) for c in (g.op, g.domain, str(g.count), g.reason, detail,
                                                  report.remedy(g), examples)))
        lines.append("")
        lines += table(rows, width, wraps=(4, 5, 6))
    return "\n".join(lines) + "\n"


def table(rows: list[tuple[str, ...]], width: int | None = None, wraps: tuple[int, ...] = ()) -> list[str]:
    """Columns as wide as their widest cell; past `width`, the columns `wraps` share what the others
    leave (each at least its longest word, the rest in proportion to what it lacks) and their
    cells wrap at spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    needed = sum(widths) + 2 * (len(widths) - 1)
    if width and needed > width and wraps:
        floors = {i: max(len(word) for r in rows for word in r[i].split() or [""]) for i in wraps}
        spare = width - (needed - sum(widths[i] for i in wraps)) - sum(floors.values())
        lacking = sum(widths[i] - floors[i] for i in wraps) or 1
        for i in wraps:
            widths[i] = floors[i] + max(0, spare) * (widths[i] - floors[i]) // lacking
    lines = []
    for row in rows:
        cells = [textwrap.wrap(c, w, break_long_words=False, break_on_hyphens=False) or [""] for c, w in zip(row, widths)]
        for k in range(max(len(c) for c in cells)):
            lines.append("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
    return lines
