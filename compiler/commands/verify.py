"""`mtkc verify OUT`: run the compiled partitions (and whole graphs) against the original model."""

from __future__ import annotations

import argparse
import json
import sys

from mtkc.commands.options import add_common
from mtkc.errors import InputError, MismatchError
from mtkc.pipeline.verify import format_text, verify


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="compare the compiled pipeline with the original model in onnxruntime",
        description="Run every partition wired by OUT/manifest.json, and every whole rewritten graph, on "
        "seeded inputs; compare each output with the original model (max abs/rel error, cosine). "
        "Graphs wired by the manifest (layer chunks: an input with `from`) run as one chain per sample. "
        "Exit 1 naming the first output that mismatches.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile`")
    parser.add_argument("--samples", type=int, default=3, help="seeded input sets (default 3)")
    parser.add_argument("--atol", type=float, default=1e-3, help="absolute tolerance (default 1e-3)")
    parser.add_argument("--rtol", type=float, default=1e-3, help="tolerance relative to each output's largest magnitude (default 1e-3)")
    parser.add_argument("--min-cosine", type=float, help="minimum cosine similarity (default 0.999; 0.99 with --quant)")
    parser.add_argument("--model", help="original model (default: the path recorded in the manifest)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format on stdout")
    from mtkc.commands.quant import add_quant_args

    add_quant_args(parser)
    add_common(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise InputError(f"--samples {args.samples}: must be at least 1")
    if args.quant:
        from mtkc.commands.quant import run_quant

        return run_quant(args)
    args.min_cosine = 0.999 if args.min_cosine is None else args.min_cosine
    result = verify(args.out, samples=args.samples, atol=args.atol, rtol=args.rtol,
                    min_cosine=args.min_cosine, model=args.model)
    if args.format == "json":
        json.dump(result.to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_text(result))
    if not result.ok:
        first = result.failures[0]
        raise MismatchError(
            f"verify: graph '{first.graph}' output '{first.output}' ({first.pipeline}) does not match the original "
            f"'{first.original}': max abs {first.max_abs:.3g}, cosine {first.cosine:.6f} "
            f"(atol {args.atol:g}, rtol {args.rtol:g}, min cosine {args.min_cosine:g})"
        )
    return 0
