"""`mtkc generate OUT --prompt-ids 1,2,3 --max-new-tokens N`: greedy tokens from compiled graphs."""

from __future__ import annotations

import argparse
import json
import sys

from mtkc.commands.options import add_common
from mtkc.errors import InputError
from mtkc.runtime.generate import Generator
from mtkc.runtime.prompts import add_prompt_args, load_prompts


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        description="Run the prefill/decode graphs of a KV-cache compile (wired by OUT/manifest.json) "
        "in onnxruntime and print the generated token ids, one line per prompt.",
    )
    parser.add_argument("out", metavar="OUT", help="folder written by `mtkc compile`")
    add_prompt_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--mask-value", type=float, help="additive mask value (default: the one compiled, recorded in the manifest)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    prompts = load_prompts(args)
    generator = Generator(args.out, mask_value=args.mask_value)
    for prompt in prompts:  # one line per prompt (JSON: one object per line)
        tokens = generator.generate(prompt.ids, args.max_new_tokens)
        if args.format == "json":
            json.dump({"tokens": tokens, **({"stopped": generator.stop_reason} if generator.stop_reason else {})},
                      sys.stdout)
            sys.stdout.write("\n")
        else:
            print(" ".join(map(str, tokens)))
    return 0
