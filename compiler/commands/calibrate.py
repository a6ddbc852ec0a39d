"""`mtkc calibrate OUT --prompts FILE`: store every NPU partition's inputs on real prompts."""

from __future__ import annotations

import argparse

from mtkc.commands.options import add_common, print_json
from mtkc.errors import InputError
from mtkc.pipeline.calibrate import calibrate, size_text
from mtkc.runtime.prompts import add_prompt_args, load_prompts


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        description="Run the compiled pipeline (reference runtime, graphs as their partitions) over each "
        "prompt: prefill, then K greedy decode steps. The NPU partitions' inputs (every prefill call, "
        "--decode-samples of the decode calls per prompt; float32 stored as float16 when it fits) are stored "
        "as OUT/calibration/<graph>.<partition>/NNNN.npz, with ranges.json (every call) and index.json; the "
        "manifest records them. Prints the disk needed first, then progress on a terminal, then time and disk.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile`")
    add_prompt_args(parser)
    parser.add_argument("--samples", type=int, metavar="N", help="use the first N prompts (default: all)")
    parser.add_argument("--decode-steps", type=int, default=8, metavar="K",
                        help="greedy decode calls after each prompt's prefill, all in ranges.json (default 8)")
    parser.add_argument("--decode-samples", type=int, default=1, metavar="S",
                        help="decode calls stored per prompt, spread over the K steps (default 1; each costs one "
                        "decode sample of disk, the announcement says how much)")
    parser.add_argument("--max-bytes", type=int, metavar="B", help="refuse (exit 2) when the samples need more disk")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="summary format on stdout")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.samples is not None and args.samples < 1:
        raise InputError(f"--samples {args.samples}: must be at least 1")
    prompts = load_prompts(args)[: args.samples]
    entry = calibrate(args.out, prompts, args.decode_steps, args.max_bytes, args.decode_samples)
    if args.format == "json":
        print_json(entry)
    else:
        for name, n in entry["samples"].items():
            print(f"{name}: {n} samples")
        print(f"wrote {args.out}/{entry['path']} ({entry['prompts']} prompts, {entry['decode_steps']} decode steps, "
              f"{entry['decode_samples']} stored per prompt; {size_text(entry['bytes'])} in {entry['seconds']:.1f} s)")
    return 0
