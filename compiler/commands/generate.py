"""`mtkc generate OUT --prompt-ids 1,2,3 --max-new-tokens N`: greedy tokens from compiled graphs.

Text mode streams each token as it is chosen: its decoded text with `--tokenizer` (control
characters escaped, new lines kept), else its id; one line per prompt. `--format json` prints
one object per prompt when it is done: `tokens` (ids), and `text` with `--tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtkc.commands.options import add_common
from mtkc.display import escape
from mtkc.errors import InputError
from mtkc.runtime import tokenizer as tokenizers
from mtkc.runtime.generate import Generator
from mtkc.runtime.prompts import add_prompt_args, check_vocab, load_prompts


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        description="Run the prefill/decode graphs of a KV-cache compile (wired by OUT/manifest.json) "
        "in onnxruntime and stream the generated tokens, one line per prompt: decoded text with "
        "--tokenizer, else token ids (--format json: ids and text).",
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
    tokenizer = tokenizers.load(args.tokenizer) if args.tokenizer else None
    prompts = load_prompts(args, tokenizer)
    generator = Generator(args.out, mask_value=args.mask_value)
    for prompt in prompts:
        check_vocab(prompt, generator.vocab)  # every prompt before the first token is printed
    for prompt in prompts:  # one line per prompt (JSON: one object per line)
        stream = Stream(tokenizer if args.format == "text" else None, args.format == "text")
        try:
            tokens = generator.generate(prompt.ids, args.max_new_tokens, emit=stream.add)
        except InputError as exc:
            raise InputError(f"{prompt.where}: {exc}") from None
        stream.end()
        if args.format == "json":
            item = {"tokens": tokens, **({"text": tokenizer.decode(tokens)} if tokenizer else {}),
                    **({"stopped": generator.stop_reason} if generator.stop_reason else {})}
            json.dump(item, sys.stdout, ensure_ascii=False)
            sys.stdout.write("\n")
    return 0


class Stream:
    """Prints tokens as they come: ids separated by spaces, or the text they add to the decoding so far
    (a token that ends inside a multi-byte character waits for the next one)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer | None, live: bool):
        self.tokenizer, self.live = tokenizer, live
        self.tokens: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if not self.live:
            return
        if self.tokenizer is None:
            sys.stdout.write(("" if len(self.tokens) == 1 else " ") + str(token))
        else:
            text = self.tokenizer.decode(self.tokens)
            if text.endswith("\ufffd") or not text.startswith(self.shown):
                return
            sys.stdout.write(_printable(text[len(self.shown):]))
            self.shown = text
        sys.stdout.flush()

    def end(self) -> None:
        if not self.live:
            return
        if self.tokenizer is not None:
            text = self.tokenizer.decode(self.tokens)
            sys.stdout.write(_printable(text[len(self.shown):] if text.startswith(self.shown) else ""))
        sys.stdout.write("\n")
        sys.stdout.flush()


def _printable(text: str) -> str:
    """Generated text as it reads: new lines kept, every other control character escaped."""
    return "\n".join(escape(line) for line in text.split("\n"))
