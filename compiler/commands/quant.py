"""`mtkc verify OUT --quant SCHEME`: the quantisation simulation's options and its thin entry."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtkc.backend.calibration_data import ENTRY, index_prompts
from mtkc.commands.options import print_json
from mtkc.errors import InputError, MismatchError
from mtkc.pipeline.quantplan import SCHEMES
from mtkc.pipeline.quantsearch import run_plan
from mtkc.pipeline.quantsim import format_text, parse_layers, simulate
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime import tokenizer as tokenizers
from mtkc.runtime.prompts import Prompt, add_prompt_args, given, load_prompts

DEFAULT_MIN_COSINE = 0.99  # the field's acceptance bar for quantised vs float outputs


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantisation simulation (needs `mtkc calibrate OUT` first)")
    group.add_argument("--quant", choices=list(SCHEMES), metavar="SCHEME",
                       help=f"simulate MediaTek's quantisation: {', '.join(SCHEMES)}")
    group.add_argument("--keep-fp", metavar="UNITS",
                       help="decoder layers (and lm_head) kept at 16 bits (mixed precision), e.g. 0,23,lm_head")
    group.add_argument("--eval", metavar="FILE", help="held-out text (needs --tokenizer): perplexity, float vs quantised")
    group.add_argument("--plan", action="store_true",
                       help="mixed precision: the fewest layers (and lm_head) raised to A16W8/A16W16 so the logits' cosine "
                       "holds --target-cosine; writes OUT/quant-plan.json (for `mtkc convert --plan`)")
    group.add_argument("--target-cosine", type=float, metavar="C", help="the plan's bar (default: --min-cosine, 0.99)")
    group.add_argument("--smooth", type=float, metavar="ALPHA",
                       help="SmoothQuant: migrate activation outliers into the weights (exact float rewrite of each "
                       "norm -> MatMul) before calibration, e.g. 0.5")
    group.add_argument("--sensitivity", action="store_true",
                       help="each layer and the LM head quantised alone: SQNR and cosine (default: when under the bar)")
    group.add_argument("--calibration-samples", type=int, metavar="N",
                       help="activation ranges from at most N stored samples per partition, evenly spaced (default: all)")
    add_prompt_args(parser, "evaluation prompt")


def run_quant(args: argparse.Namespace) -> int:

    if args.new_tokens < 1:
        raise InputError(f"--new-tokens {args.new_tokens}: must be at least 1")
    min_cosine = DEFAULT_MIN_COSINE if args.min_cosine is None else args.min_cosine
    prompts = [p.ids for p in (load_prompts(args) if given(args) else calibration_prompts(args.out)[: args.samples])]
    if args.calibration_samples is not None and args.calibration_samples < 1:
        raise InputError(f"--calibration-samples {args.calibration_samples}: must be at least 1")
    if args.smooth is not None and not 0 <= args.smooth <= 1:
        raise InputError(f"--smooth {args.smooth:g}: alpha is in [0, 1]")
    if args.plan:
        if args.keep_fp:
            raise InputError("--plan chooses the raised layers itself: drop --keep-fp")
        target = min_cosine if args.target_cosine is None else args.target_cosine
        if not 0 < target <= 1:
            raise InputError(f"--target-cosine {target:g}: expected a value in (0, 1]")
        result = run_plan(args.out, args.quant, prompts, args.new_tokens, target, args.calibration_samples, eval_ids(args),
                          args.smooth)
    elif args.target_cosine is not None:
        raise InputError("--target-cosine is the bar of --plan; give --plan (or use --min-cosine)")
    else:
        result = simulate(args.out, args.quant, prompts, args.new_tokens, parse_layers(args.keep_fp), min_cosine,
                          args.calibration_samples, eval_ids=eval_ids(args), sensitivity=args.sensitivity or None,
                          smooth=args.smooth)
    if args.format == "json":
        print_json(result.to_json())
    else:
        print(format_text(result, every_output=args.verbose > 0))
    if not result.ok:
        worst = min(result.under_bar, key=lambda o: o["cosine"])
        hint = f"; try {result.suggestion()}" if result.suggestion() else ""
        raise MismatchError(f"verify --quant {args.quant}: graph '{worst['graph']}' output '{worst['output']}' cosine "
                            f"{worst['cosine']:.6f} is under {min_cosine:g}{hint}")
    return 0


def eval_ids(args: argparse.Namespace) -> list[int] | None:
    """The token ids of `--eval FILE`, read as UTF-8 text and encoded with `--tokenizer`."""
    if not args.eval:
        return None
    if not args.tokenizer:
        raise InputError(f"--eval {args.eval}: held-out text needs --tokenizer DIR")
    try:
        text = Path(args.eval).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--eval {args.eval}: cannot read the text ({exc})") from None
    ids = tokenizers.load(args.tokenizer).encode(text, special=False)
    if len(ids) < 2:
        raise InputError(f"--eval {args.eval}: fewer than 2 tokens to score")
    return ids


def calibration_prompts(out: str) -> list[Prompt]:
    """The prompts `mtkc calibrate` ran (its index), when none is given on the command line."""
    index = f"{out}/{ENTRY['index']}"
    return [Prompt(ids, None, f"{index}: prompts[{k}]") for k, ids in enumerate(index_prompts(out, load_manifest(out)))]
