"""Prompt inputs shared by `generate`, `verify --quant` and `calibrate`: ids or text, one or a file.

    --prompt-ids 1,2,3            token ids as given
    --prompt TEXT                 one text prompt            ┐ need --tokenizer DIR (a Hugging Face
    --prompts FILE                one prompt per line, or    ┘ tokenizer folder, read offline)
                                  JSONL: {"text": ...} or {"ids": [...]} per line
    --chat-template               wrap each text as a user turn of the tokenizer's chat template

The file is untrusted: read once, at most MAX_FILE bytes, each line at most MAX_LINE; UTF-8
(a leading BOM is dropped). It is JSONL when its name ends in `.jsonl` or its first prompt line
starts with `{`; then every line must be a JSON object of bounded nesting (MAX_DEPTH) whose
ids are integers below 2^31 and whose text is valid Unicode. Every prompt remembers where it
came from (`--prompt-ids`, `--prompt`, `FILE:LINE`), and every error names it.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mtkc.errors import InputError
from mtkc.runtime import template, tokenizer as tokenizers

MAX_FILE = 64 << 20  # bytes
MAX_LINE = 1 << 20  # bytes per line
MAX_DEPTH = 8  # JSON nesting per line; a prompt needs 2
MAX_ID = 2**31 - 1
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None = None  # the source text, when the prompt was given as text
    where: str = "--prompt-ids"  # the option or FILE:LINE it came from, for error messages


def add_prompt_args(parser: argparse.ArgumentParser, what: str = "prompt") -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument("--prompt-ids", help=f"comma-separated {what} token ids, e.g. 1,2,3")
    group.add_argument("--prompt", metavar="TEXT", help=f"{what} text (needs --tokenizer)")
    group.add_argument("--prompts", metavar="FILE", help="prompts, one per line; or JSONL with `text` or `ids` per line")
    group.add_argument("--tokenizer", metavar="DIR", help="Hugging Face tokenizer folder (read offline)")
    group.add_argument("--chat-template", action="store_true", help="apply the tokenizer's chat template to text prompts")


def given(args: argparse.Namespace) -> bool:
    """Whether any prompt option was given."""
    return any(getattr(args, k, None) for k in ("prompt_ids", "prompt", "prompts"))


def load_prompts(args: argparse.Namespace, tokenizer: tokenizers.Tokenizer | None = None) -> list[Prompt]:
    """Every prompt the options name, in order: --prompt-ids, --prompt, then --prompts FILE.
    `tokenizer`: one already loaded from `args.tokenizer` (else loaded here when a text needs it)."""
    entries: list[tuple[str, str | list[int]]] = []  # (where, text or ids)
    if args.prompt_ids:
        entries.append(("--prompt-ids", parse_ids(args.prompt_ids)))
    if args.prompt is not None:
        entries.append(("--prompt", _valid_text(args.prompt, "--prompt")))
    if args.prompts:
        entries += read_file(Path(args.prompts))
    if not entries:
        raise InputError("no prompt: give --prompt-ids, --prompt TEXT or --prompts FILE")
    texts = [(where, item) for where, item in entries if isinstance(item, str)]
    if not texts:
        return [Prompt(item, None, where) for where, item in entries]
    if not args.tokenizer:
        raise InputError(f"{texts[0][0]}: a text prompt needs --tokenizer DIR (or give token ids)")
    tokenizer = tokenizer or tokenizers.load(args.tokenizer)
    chat = bool(getattr(args, "chat_template", False))
    sources = [text for _, text in texts]
    rendered = dict(zip([where for where, _ in texts], _chat(tokenizer, sources) if chat else sources))
    prompts = []
    for where, item in entries:
        if isinstance(item, list):
            prompts.append(Prompt(item, None, where))
            continue
        try:
            ids = tokenizer.encode(rendered[where], special=not chat)
        except Exception as exc:  # the tokenizer library's own errors on text it cannot take
            raise InputError(f"{where}: the tokenizer cannot encode it ({type(exc).__name__})") from None
        if not ids:
            raise InputError(f"{where}: the text encodes to no tokens")
        prompts.append(Prompt(ids, item, where))
    return prompts


def check_vocab(prompt: Prompt, vocab: int) -> None:
    """InputError naming where the prompt came from when an id is outside the model's vocabulary."""
    bad = next((x for x in prompt.ids if not 0 <= x < vocab), None)
    if bad is not None:
        source = " (from the --tokenizer's encoding)" if prompt.text is not None else ""
        raise InputError(f"{prompt.where}: token id {bad}{source} is outside the vocabulary (0..{vocab - 1})")


def parse_ids(text: str, where: str = "--prompt-ids") -> list[int]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not all(re.fullmatch(r"-?\d+", x) for x in parts):
        raise InputError(f"{where} '{_short(text)}': expected comma-separated integers")
    if not parts or not all(len(x) <= 10 and 0 <= int(x) <= MAX_ID for x in parts):
        raise InputError(f"{where} '{_short(text)}': expected at least one non-negative token id, each below 2^31")
    return [int(x) for x in parts]


def read_file(path: Path) -> list[tuple[str, str | list[int]]]:
    """(FILE:LINE, text or ids) per prompt line; blank lines skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read prompts ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE:
        raise InputError(f"{path}: larger than {MAX_FILE >> 20} MiB; prompts files are read whole")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    numbered = []
    for k, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path}:{k}"
        if len(raw) > MAX_LINE:
            raise InputError(f"{where}: the line is longer than {MAX_LINE >> 20} MiB")
        if b"\0" in raw:
            raise InputError(f"{where}: holds a NUL byte (not a text file)")
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where}: not UTF-8 text (byte {exc.start + 1})") from None
        if line.strip():
            numbered.append((where, line))
    if not numbered:
        raise InputError(f"{path}: no prompts in the file")
    if not (path.suffix == ".jsonl" or numbered[0][1].lstrip().startswith("{")):
        return numbered
    return [(where, _json_prompt(line, where)) for where, line in numbered]


def _json_prompt(line: str, where: str) -> str | list[int]:
    """One JSONL line: {"ids": [...]} or {"text": "..."}."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub("", line)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise InputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        item = json.loads(line, parse_int=_bounded_int, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: {exc}") from None
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a JSON object with `text` or `ids`")
    if isinstance(item.get("ids"), list):
        ids = item["ids"]
        if not ids or not all(type(x) is int and 0 <= x <= MAX_ID for x in ids):
            raise InputError(f"{where}: `ids` must be a non-empty list of integers in 0..2^31-1")
        return ids
    if isinstance(item.get("text"), str):
        return _valid_text(item["text"], where)
    raise InputError(f"{where}: expected a `text` string or an `ids` list")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 10:
        raise ValueError(f"integer of {len(text)} digits (token ids are below 2^31)")
    return int(text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a token id or text")


def _valid_text(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where}: the text holds a lone surrogate (\\u{ord(text[exc.start]):04x}), not Unicode") from None
    return text


def _chat(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> list[str]:
    """Each text as a user turn of the tokenizer's chat template, rendered in the bounded sandbox."""
    source, where = tokenizer.chat_template()
    return template.render(source, where, [[{"role": "user", "content": t}] for t in texts], tokenizer.variables())


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
