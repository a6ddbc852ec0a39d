"""`mtkc verify OUT`: run the compiled partitions (and whole graphs) against the original model."""

from __future__ import annotations

import argparse

from mtkc.commands.options import add_common, print_json
from mtkc.commands.quant import add_quant_args, run_quant
from mtkc.errors import InputError, MismatchError
from mtkc.options import check_tolerances
from mtkc.pipeline.oracle import NEW_TOKENS
from mtkc.pipeline.verify import format_text, verify


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        description="The oracle: run the original export as its exporter meant it (cache "
        "growing from empty, its own mask, no padding) and the compiled graphs through the reference runtime on "
        "seeded prompts shorter and longer than T; compare logits at real positions and greedy tokens. Then run "
        "every partition wired by OUT/manifest.json, and every whole rewritten graph, on "
        "seeded inputs; compare each output with the original model (max abs/rel error, cosine). "
        "Exit 2 when the model is not the one compiled (sha256). Nothing compared is never ok. "
        "Graphs wired by the manifest (layer chunks: an input with `from`) run as one chain per sample. "
        "Exit 1 naming the first output that mismatches.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile`")
    parser.add_argument("--samples", type=int, default=3, help="seeded input sets (default 3)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default 1e-3; 1e-2 for an fp16 export)")
    parser.add_argument("--rtol", type=float, help="tolerance relative to each output's largest magnitude "
                        "(default 1e-3; 1e-2 for an fp16 export)")
    parser.add_argument("--min-cosine", type=float, help="minimum cosine similarity (default 0.999; 0.99 with --quant)")
    parser.add_argument("--model", help="original model (default: the path recorded in the manifest; "
                        "its sha256 must be the compiled one's)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, metavar="N",
                        help=f"greedy tokens per prompt compared (the oracle; with --quant, against float) (default {NEW_TOKENS}; 0: per-graph only)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format on stdout")
    add_quant_args(parser)
    add_common(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise InputError(f"--samples {args.samples}: must be at least 1")
    if args.new_tokens < 0:
        raise InputError(f"--new-tokens {args.new_tokens}: must be >= 0")
    if args.quant:
        return run_quant(args)
    args.min_cosine = 0.999 if args.min_cosine is None else args.min_cosine
    check_tolerances(0.0 if args.atol is None else args.atol, 0.0 if args.rtol is None else args.rtol, args.min_cosine)
    result = verify(args.out, samples=args.samples, atol=args.atol, rtol=args.rtol,
                    min_cosine=args.min_cosine, model=args.model, new_tokens=args.new_tokens)
    if args.format == "json":
        print_json(result.to_json())
    else:
        print(format_text(result, every_output=args.verbose > 0))
    if not result.ok:
        raise MismatchError(result.failure())
    return 0
