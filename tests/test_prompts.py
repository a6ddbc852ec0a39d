"""Prompt inputs: ids, text through a local tokenizer folder (optionally its chat template), files."""

from __future__ import annotations

import argparse
import json

import pytest

from mtkc.errors import InputError
from mtkc.runtime.prompts import Prompt, add_prompt_args, load_prompts

WORDS = ["<pad>", "<unk>", "hello", "world", "how", "are", "you", "user", ":", "assistant"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level Hugging Face tokenizer folder (no hub), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}" \
                         "{% if add_generation_prompt %}assistant :{% endif %}"
    folder = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(folder)
    return folder


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_prompt_args(parser)
    return parser.parse_args(list(map(str, argv)))


def test_ids_text_lines_and_jsonl(tokenizer_dir, tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("hello world\n\nhow are you\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"text": "you are"}) + "\n" + json.dumps({"ids": [4, 5]}) + "\n")
    assert load_prompts(_args("--prompt-ids", "1, 2,3")) == [Prompt([1, 2, 3])]
    got = load_prompts(_args("--prompt", "hello you", "--prompts", lines, "--tokenizer", tokenizer_dir))
    assert [p.ids for p in got] == [[2, 6], [2, 3], [4, 5, 6]] and got[0].text == "hello you"
    got = load_prompts(_args("--prompts", jsonl, "--tokenizer", tokenizer_dir))
    assert [p.ids for p in got] == [[6, 5], [4, 5]]
    chat = load_prompts(_args("--prompt", "hello", "--tokenizer", tokenizer_dir, "--chat-template"))
    assert chat[0].ids == [7, 8, 2, 9, 8]


@pytest.mark.parametrize("argv,message", [
    (("--prompt", "hello"), "needs --tokenizer"),
    (("--prompt-ids", "1,x"), "expected comma-separated integers"),
    ((), "no prompt"),
    (("--prompt", "hi", "--tokenizer", "/nonexistent-tokenizer"), "not a folder"),
])
def test_bad_prompt_options_are_input_errors(argv, message):
    with pytest.raises(InputError, match=message):
        load_prompts(_args(*argv))


def test_bad_files_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"ids": [1, -2]}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: `ids` must be"):
        load_prompts(_args("--prompts", bad))
    bad.write_text('{"ids": [1]}\n{"txt": "x"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: expected a `text`"):
        load_prompts(_args("--prompts", bad))
    with pytest.raises(InputError, match="cannot read prompts"):
        load_prompts(_args("--prompts", tmp_path / "missing.txt"))


def test_chat_template_missing_is_an_input_error(tokenizer_dir, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tokenizer_dir, plain)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = plain / name
        if name == "chat_template.jinja":
            path.unlink(missing_ok=True)
        elif path.exists():
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
    with pytest.raises(InputError, match="has no chat template"):
        load_prompts(_args("--prompt", "hello", "--tokenizer", plain, "--chat-template"))
