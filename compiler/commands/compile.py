"""`mtkc compile MODEL --sdk VER -o OUT`: rewrite the whole graph for an SDK and write it."""

from __future__ import annotations

import argparse
import logging

from mtkc.commands.options import add_common, add_llm, add_pipeline, add_shapes, add_target, from_args, with_sdk
from mtkc.commands.partitioning import add_converter, add_placement
from mtkc.display import escape
from mtkc.pipeline.registry import load_registry
from mtkc.pipeline.compile import compile_model, default_output

log = logging.getLogger("mtkc")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model.onnx (external data beside it)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="output folder, written atomically (default: a new <model>.mtkc-<sdk> folder here)")
    add_target(p, required=False)
    add_shapes(p)
    add_pipeline(p)
    add_llm(p)
    p.add_argument("--verify-each", action="store_true", default=None, help="run onnxruntime after every changing pass; name the first that changes the numbers")
    p.add_argument("--explain", metavar="PASS", help="print the sites PASS looked at and refused, with the reason")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_placement(p)
    add_converter(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    options = with_sdk(from_args(args))
    if args.explain:
        load_registry(options.plugins).get(args.explain)  # unknown -> InputError, before any work
    out = args.output
    if out is None:
        out = default_output(args.model, options.sdk)
        log.info("mtkc: output folder %s (choose one with -o)", out)
    result = compile_model(args.model, options.sdk, out, options)
    if args.explain:
        print(explain(result, args.explain))
    graph = result.variants[0].graph
    log.info(
        "mtkc: wrote %s (%s, %d nodes; %d passes, %d rewrites)",
        out, ", ".join(g["path"] for g in result.manifest["graphs"]), len(graph.nodes),
        len(result.records), sum(r.rewrites for r in result.records),
    )
    converter = result.manifest.get("converter") or {}
    for line in cpu_summary(result.variants):
        log.info("%s", line)
    if not converter.get("ran"):
        log.warning("mtkc: no converter ran (%s)", converter.get("reason") or "see report.md")
    return 0


def cpu_summary(variants) -> list[str]:
    """One line per (op, reason) of the nodes left on the CPU, over every graph, for the terminal."""
    counts: dict[tuple[str, str], list] = {}
    for v in variants:
        ops = {n.name: n.op for n in v.graph.nodes}
        for name, p in (v.split.placements.items() if v.split is not None else ()):
            if p.target != "npu" and name in ops:
                entry = counts.setdefault((ops[name], p.reason), [0, p.detail])
                entry[0] += 1
    return [f"mtkc: CPU: {escape(op)} x{n} ({reason}: {escape(str(detail))})"
            for (op, reason), (n, detail) in sorted(counts.items())]


def explain(result, name: str) -> str:
    """The misses of pass `name`: one line per refused site with its first failing condition; then
    the decoder layers the DecoderMap refused, with their block and reason."""
    refused = [escape(x.refusal()) for x in result.build.decoder.refused]
    records = [r for r in result.records if r.name == name]
    if not records:
        why = next((s["reason"] for s in result.report["skipped"] if s["name"] == name), "not in the pipeline")
        return "\n".join([f"{name}: did not run ({why})", *refused])
    lines = []
    several = len(result.variants) > 1
    for r in records:
        lines.append(f"{name}{f' [{r.graph}]' if several else ''}: {r.rewrites} rewrites, {len(r.misses)} misses")
        lines += [f"  {escape(m.node)}: {escape(m.reason)}" for m in r.misses]
    return "\n".join(lines + refused)
