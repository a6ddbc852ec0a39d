"""A Hugging Face tokenizer folder, loaded as untrusted data: offline, never its code.

A folder whose `tokenizer_config.json` or `config.json` maps classes to its own Python files
(`auto_map`) asks `transformers` to import and run them; mtkc refuses it before transformers
sees it (exit 2 naming the file) and loads every other folder with `trust_remote_code=False`,
so the library never asks a question on stdin either. The chat template is text handed to
`mtkc.runtime.template` (a bounded sandbox), not to transformers' renderer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtkc.errors import InputError
from mtkc.ir.outdir import read_json

CONFIGS = ("tokenizer_config.json", "config.json")  # the files whose `auto_map` names code
MAX_CONFIG = 64 << 20  # bytes; a real tokenizer_config.json (with its template) is well under 1 MB


@dataclass
class Tokenizer:
    """The loaded tokenizer and where its chat template came from (for error messages)."""

    folder: str
    impl: object  # a transformers PreTrainedTokenizerBase

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.impl(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids, skip_special_tokens=True)

    def chat_template(self) -> tuple[str, str]:
        """(template text, where it came from); InputError when the folder has none."""
        template = getattr(self.impl, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise InputError(f"--tokenizer {self.folder}: --chat-template given but the tokenizer has no chat template")
        jinja = Path(self.folder) / "chat_template.jinja"
        return template, str(jinja if jinja.is_file() else Path(self.folder) / "tokenizer_config.json")

    def variables(self) -> dict[str, str]:
        """The special tokens a template may name (`bos_token`, `eos_token`, ...), as text."""
        tokens = getattr(self.impl, "special_tokens_map", {}) or {}
        return {k: v for k, v in tokens.items() if isinstance(v, str)}


def load(folder: str) -> Tokenizer:
    """`transformers.AutoTokenizer` from a local folder: never the network, never the folder's code."""
    path = Path(folder)
    if not path.is_dir():
        raise InputError(f"--tokenizer {folder}: not a folder")
    for name in CONFIGS:
        refuse_code(path / name)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError("--tokenizer needs the `transformers` package (pip install transformers)") from None
    try:
        impl = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a folder it cannot use
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"--tokenizer {folder}: cannot load a tokenizer ({first[:200]})") from None
    return Tokenizer(folder, impl)


def refuse_code(config: Path) -> None:
    """InputError when `config` (a JSON file of the folder, if present) maps classes to custom code."""
    if not config.exists():
        return
    parsed = read_json(config, MAX_CONFIG, "not a readable JSON file")
    if not isinstance(parsed, dict):
        raise InputError(f"{config}: expected a JSON object")
    if parsed.get("auto_map"):
        raise InputError(f"{config}: `auto_map` names custom tokenizer code; mtkc never runs a folder's code "
                         "(use a folder without it)")
