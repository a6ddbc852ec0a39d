"""`mtkc calibrate OUT --prompts FILE`: store every NPU partition's inputs on real prompts."""

from __future__ import annotations

import argparse

from mtkc.commands.options import add_common, print_json
from mtkc.errors import InputError
from mtkc.pipeline.calibrate import calibrate
from mtkc.runtime.prompts import add_prompt_args, load_prompts


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        description="Run the compiled pipeline (reference runtime, graphs as their partitions) over each "
        "prompt: prefill, then K greedy decode steps. Every NPU partition's inputs are stored as "
        "OUT/calibration/<graph>.<partition>/NNNN.npz, with ranges.json and index.json; the manifest "
        "records them. Prints the disk needed first.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile`")
    add_prompt_args(parser)
    parser.add_argument("--samples", type=int, metavar="N", help="use the first N prompts (default: all)")
    parser.add_argument("--decode-steps", type=int, default=8, metavar="K",
                        help="greedy decode calls after each prompt's prefill (default 8)")
    parser.add_argument("--max-bytes", type=int, metavar="B", help="refuse (exit 2) when the samples need more disk")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="summary format on stdout")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.samples is not None and args.samples < 1:
        raise InputError(f"--samples {args.samples}: must be at least 1")
    prompts = load_prompts(args)[: args.samples]
    entry = calibrate(args.out, prompts, args.decode_steps, args.max_bytes)
    if args.format == "json":
        print_json(entry)
    else:
        for name, n in entry["samples"].items():
            print(f"{name}: {n} samples")
        print(f"wrote {args.out}/{entry['path']} ({entry['prompts']} prompts, {entry['decode_steps']} decode steps)")
    return 0
