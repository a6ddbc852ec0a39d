"""Prompt inputs shared by `generate`, `verify --quant` and `calibrate`: ids or text, one or a file.

    --prompt-ids 1,2,3            token ids as given
    --prompt TEXT                 one text prompt            ┐ need --tokenizer DIR (a Hugging Face
    --prompts FILE                one prompt per line, or    ┘ tokenizer folder, read offline)
                                  JSONL: {"text": ...} or {"ids": [...]} per line
    --chat-template               wrap each text as a user turn of the tokenizer's chat template

Text without a tokenizer, an unreadable file or a malformed line is an InputError naming it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from mtkc.errors import InputError


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None = None  # the source text, when the prompt was given as text


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


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    """Every prompt the options name, in order: --prompt-ids, --prompt, then --prompts FILE."""
    entries: list[tuple[str, str | list[int]]] = []  # (where, text or ids)
    if args.prompt_ids:
        entries.append(("--prompt-ids", parse_ids(args.prompt_ids)))
    if args.prompt is not None:
        entries.append(("--prompt", args.prompt))
    if args.prompts:
        entries += read_file(Path(args.prompts))
    if not entries:
        raise InputError("no prompt: give --prompt-ids, --prompt TEXT or --prompts FILE")
    tokenizer = None
    texts = [where for where, item in entries if isinstance(item, str)]
    if texts:
        if not args.tokenizer:
            raise InputError(f"{texts[0]}: a text prompt needs --tokenizer DIR (or give token ids)")
        tokenizer = load_tokenizer(args.tokenizer)
    prompts = []
    for where, item in entries:
        if isinstance(item, str):
            ids = encode(tokenizer, item, getattr(args, "chat_template", False), args.tokenizer)
            if not ids:
                raise InputError(f"{where}: the text encodes to no tokens")
            prompts.append(Prompt(ids, item))
        else:
            prompts.append(Prompt(item))
    return prompts


def parse_ids(text: str, where: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{where} '{text}': expected comma-separated integers") from None
    if not ids or any(x < 0 for x in ids):
        raise InputError(f"{where} '{text}': expected at least one non-negative token id")
    return ids


def read_file(path: Path) -> list[tuple[str, str | list[int]]]:
    """Plain lines (blank lines skipped), or JSONL when every non-blank line is a JSON object."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read prompts ({getattr(exc, 'strerror', None) or exc})") from None
    numbered = [(k + 1, line) for k, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise InputError(f"{path}: no prompts in the file")
    if not all(line.lstrip().startswith("{") for _, line in numbered):
        return [(f"{path}:{k}", line) for k, line in numbered]
    entries = []
    for k, line in numbered:
        where = f"{path}:{k}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        if isinstance(item.get("ids"), list):
            ids = item["ids"]
            if not ids or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise InputError(f"{where}: `ids` must be a non-empty list of non-negative integers")
            entries.append((where, [int(x) for x in ids]))
        elif isinstance(item.get("text"), str):
            entries.append((where, item["text"]))
        else:
            raise InputError(f"{where}: expected a `text` string or an `ids` list")
    return entries


def load_tokenizer(folder: str):
    """`transformers.AutoTokenizer` from a local folder, never the network."""
    path = Path(folder)
    if not path.is_dir():
        raise InputError(f"--tokenizer {folder}: not a folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError("--tokenizer needs the `transformers` package (pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a folder it cannot use
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"--tokenizer {folder}: cannot load a tokenizer ({first[:200]})") from None


def encode(tokenizer, text: str, chat: bool, folder: str) -> list[int]:
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"--tokenizer {folder}: --chat-template given but the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
