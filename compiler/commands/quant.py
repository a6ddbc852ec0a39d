"""`mtkc verify OUT --quant SCHEME`: the quantisation simulation's options and its thin entry."""

from __future__ import annotations

import argparse

from mtkc.backend.calibration_data import ENTRY, index_prompts
from mtkc.commands.options import print_json
from mtkc.errors import InputError, MismatchError
from mtkc.pipeline.quantsim import SCHEMES, format_text, parse_layers, simulate
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.prompts import Prompt, add_prompt_args, given, load_prompts

DEFAULT_MIN_COSINE = 0.99  # the field's acceptance bar for quantised vs float outputs


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantisation simulation (needs `mtkc calibrate OUT` first)")
    group.add_argument("--quant", choices=list(SCHEMES), metavar="SCHEME",
                       help=f"simulate MediaTek's quantisation: {', '.join(SCHEMES)}")
    group.add_argument("--keep-fp", metavar="LAYERS", help="decoder layers kept at 16 bits (mixed precision), e.g. 0,23")
    group.add_argument("--calibration-samples", type=int, metavar="N",
                       help="activation ranges from at most N stored samples per partition, evenly spaced (default: all)")
    add_prompt_args(parser, "evaluation prompt")


def run_quant(args: argparse.Namespace) -> int:

    if args.new_tokens < 1:
        raise InputError(f"--new-tokens {args.new_tokens}: must be at least 1")
    min_cosine = DEFAULT_MIN_COSINE if args.min_cosine is None else args.min_cosine
    prompts = load_prompts(args) if given(args) else calibration_prompts(args.out)[: args.samples]
    if args.calibration_samples is not None and args.calibration_samples < 1:
        raise InputError(f"--calibration-samples {args.calibration_samples}: must be at least 1")
    result = simulate(args.out, args.quant, prompts, args.new_tokens, parse_layers(args.keep_fp), min_cosine,
                      args.calibration_samples)
    if args.format == "json":
        print_json(result.to_json())
    else:
        print(format_text(result))
    if not result.ok:
        worst = min(result.under_bar, key=lambda o: o["cosine"])
        hint = f"; try {result.suggestion()}" if result.suggestion() else ""
        raise MismatchError(f"verify --quant {args.quant}: graph '{worst['graph']}' output '{worst['output']}' cosine "
                            f"{worst['cosine']:.6f} is under {min_cosine:g}{hint}")
    return 0


def calibration_prompts(out: str) -> list[Prompt]:
    """The prompts `mtkc calibrate` ran (its index), when none is given on the command line."""
    index = f"{out}/{ENTRY['index']}"
    return [Prompt(ids, None, f"{index}: prompts[{k}]") for k, ids in enumerate(index_prompts(out, load_manifest(out)))]
