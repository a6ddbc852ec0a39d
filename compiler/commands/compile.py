"""`mtkc compile MODEL --sdk VER -o OUT`: rewrite the whole graph for an SDK and write it."""

from __future__ import annotations

import argparse
import logging
import math

from mtkc.commands.options import add_common, add_pipeline, add_shapes, add_target
from mtkc.commands.partitioning import add_partitioning, partitioning_options
from mtkc.errors import InputError

log = logging.getLogger("mtkc")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="rewrite a model for an SDK and write OUT/ (graph, weights, manifest)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model.onnx (external data beside it)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder (written atomically)")
    add_target(p, required=False)
    add_shapes(p)
    add_pipeline(p)
    kv = p.add_argument_group("KV cache (prefill/decode graphs)")
    kv.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="write prefill + decode graphs over a static cache (default: when the model has cache inputs)")
    kv.add_argument("--cache-io", choices=["new", "sliding"], help="present_* outputs: new entries [1,Hkv,T,D] (default) or the slid cache")
    kv.add_argument("--chunks", type=int, metavar="N", help="split the decoder layers into N graphs per variant")
    llm = p.add_argument_group("LLM blocks")
    llm.add_argument("--mask-value", type=float, metavar="V",
                     help="masked value of the additive attention_mask input (default -100, as MediaTek's runtime)")
    llm.add_argument("--rope-mode", choices=["table", "pos_emb"],
                     help="RoPE cos/sin: a constant table gathered by position_ids (default), or a pos_emb [1,2,T,D] input")
    llm.add_argument("--embedding", choices=["host-input", "cpu"],
                     help="token embedding on the host: hidden_states input (default), or a CPU partition")
    llm.add_argument("--merge-gate-up", action="store_true", default=None,
                     help="merge the SwiGLU gate and up projections into one MatMul + Split")
    p.add_argument("--verify-each", action="store_true", default=None, help="run onnxruntime after every changing pass; name the first that changes the numbers")
    p.add_argument("--explain", metavar="PASS", help="print the sites PASS looked at and refused, with the reason")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_partitioning(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mtkc.manager.pass_manager import load_registry
    from mtkc.pipeline.compile import compile_model
    from mtkc.pipeline.config import from_args

    options = from_args(args)
    options.update(partitioning_options(args))
    options.update(_llm_options(args))
    sdk = options.pop("sdk")
    if not sdk:
        raise InputError("--sdk is required (or set sdk in mtkc.toml)")
    options["overwrite"] = args.overwrite
    if args.explain:
        load_registry(options["plugins"]).get(args.explain)  # unknown -> InputError, before any work
    result = compile_model(args.model, sdk, args.output, options)
    if args.explain:
        print(explain(result, args.explain))
    graph = result.variants[0].graph
    log.info(
        "mtkc: wrote %s (%s, %d nodes; %d passes, %d rewrites)",
        args.output, ", ".join(g["path"] for g in result.manifest["graphs"]), len(graph.nodes),
        len(result.records), sum(r.rewrites for r in result.records),
    )
    for line in cpu_summary(result.variants):
        log.info("%s", line)
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
    return [f"mtkc: CPU: {op} x{n} ({reason}: {detail})" for (op, reason), (n, detail) in sorted(counts.items())]


def _llm_options(args) -> dict:
    """Pass options given on the command line (they override `[pass_options]` of the config)."""
    given = {key: getattr(args, key) for key in ("mask_value", "rope_mode", "embedding", "merge_gate_up")}
    given = {key: value for key, value in given.items() if value is not None}
    value = given.get("mask_value")
    if value is not None and not (value < 0 and math.isfinite(value)):
        raise InputError(f"--mask-value {value:g}: expected a finite negative number (e.g. -100)")
    return given


def explain(result, name: str) -> str:
    """The misses of pass `name`: one line per refused site with its first failing condition."""
    records = [r for r in result.records if r.name == name]
    if not records:
        why = next((s["reason"] for s in result.report["skipped"] if s["name"] == name), "not in the pipeline")
        return f"{name}: did not run ({why})"
    lines = []
    several = len(result.variants) > 1
    for r in records:
        lines.append(f"{name}{f' [{r.graph}]' if several else ''}: {r.rewrites} rewrites, {len(r.misses)} misses")
        lines += [f"  {m.node}: {m.reason}" for m in r.misses]
    return "\n".join(lines)
