"""Bad option values (issue 12 class 7): one typed Options validated in one place, so the CLI of
`check` and `compile` and a config file refuse the same values with one line naming the source."""

from __future__ import annotations

import math

import pytest

from mtkc import cli
from mtkc.errors import InputError
from mtkc.options import MAX_LEN, Options, of

BAD_FLAGS = [
    (["--seq-len", "0"], "--seq-len: expected an integer in 1..131072, got 0"),
    (["--seq-len", "-5"], "--seq-len: expected an integer in 1..131072, got -5"),
    (["--seq-len", str(2 ** 40)], f"--seq-len: expected an integer in 1..131072, got {2 ** 40}"),
    (["--cache-len", "0"], "--cache-len: expected an integer in 1..131072, got 0"),
    (["--batch", "0"], "--batch: expected an integer in 1..1024, got 0"),
    (["--chunks", "0"], "--chunks: expected an integer in 1..131072, got 0"),
    (["--rope-mode", "banana"], "--rope-mode: expected one of table, pos_emb, got 'banana'"),
    (["--cache-io", "old"], "--cache-io: expected one of new, sliding, got 'old'"),
    (["--embedding", "gpu"], "--embedding: expected one of host-input, cpu, got 'gpu'"),
    (["--mask-value=5"], "--mask-value: expected a finite negative number (e.g. -100), got 5.0"),
    (["--mask-value=nan"], "--mask-value: expected a finite negative number (e.g. -100), got nan"),
    (["--mask-value=-inf"], "--mask-value: expected a finite negative number (e.g. -100), got -inf"),
    (["--seq-len", "65536", "--cache-len", "65536"], "--seq-len 65536 with --cache-len 65536: the attention mask"),
    (["--input-shape", "input_ids=1,0"], "--input-shape: expected a table of input name = [positive dims]"),
]
BAD_CONFIG = [
    ("seq_len = -5\n", "seq_len: expected an integer in 1..131072, got -5"),
    ("force_cpu = 5\n", "force_cpu: expected a list of names, got 5"),
    ("verify_each = 1\n", "verify_each: expected true or false, got 1"),
    ("[input_shapes]\ninput_ids = [1, true]\n", "input_shapes: expected a table of input name = [positive dims]"),
    ("rope_mode = 'banana'\n", "rope_mode: expected one of table, pos_emb, got 'banana'"),
    ("mask_value = nan\n", "mask_value: expected a finite negative number (e.g. -100), got nan"),
    ("mask_value = 1e3\n", "mask_value: expected a finite negative number (e.g. -100), got 1000.0"),
    ("[pass_options]\nmine = 3\n", "pass_options: expected a table of [pass_options.<pass name>] tables"),
]


def mtkc(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def model(exported):
    return exported("qwen2", "legacy17", cache=True)


@pytest.mark.parametrize("command", ["check", "compile"])
@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_flags_are_one_line_exit_2_in_check_and_compile(capsys, model, tmp_path, command, flags, message):
    extra = ["-o", tmp_path / "out"] if command == "compile" else []
    code, out, err = mtkc(capsys, command, model, "--sdk", "8.0", *extra, *flags)
    assert (code, out) == (2, "")
    assert err.startswith(f"mtkc: error: {message}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["check", "compile"])
@pytest.mark.parametrize("text, message", BAD_CONFIG)
def test_a_config_file_gets_no_further_than_the_cli(capsys, model, tmp_path, command, text, message):
    config = tmp_path / "mtkc.toml"
    config.write_text(text)
    extra = ["-o", tmp_path / "out"] if command == "compile" else []
    code, out, err = mtkc(capsys, command, model, "--sdk", "8.0", "--config", config, *extra)
    assert (code, out) == (2, "")
    assert err.startswith(f"mtkc: error: {config}:{message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mtkc.toml"]


def test_binary_config_and_directory_config(capsys, model, tmp_path):
    config = tmp_path / "mtkc.toml"
    config.write_bytes(bytes(range(256)) * 4)
    code, _, err = mtkc(capsys, "check", model, "--sdk", "8.0", "--config", config)
    assert code == 2 and err.startswith(f"mtkc: error: {config}: not a readable TOML file") and err.count("\n") == 1
    code, _, err = mtkc(capsys, "check", model, "--sdk", "8.0", "--config", tmp_path)
    assert code == 2 and err.strip() == f"mtkc: error: {tmp_path}: is a directory, not a config file"


def test_chunks_beyond_the_layers_is_checked_where_layers_are_known(capsys, model, tmp_path):
    code, _, err = mtkc(capsys, "compile", model, "--sdk", "8.0", "-o", tmp_path / "out", "--chunks", "64")
    assert code == 2 and "--chunks 64" in err and "decoder layers" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_options_are_frozen_and_typed():
    options = of({"seq_len": 8, "passes": ["fold"], "input_shapes": {"x": [1, 8]}})
    assert options == Options(seq_len=8, passes=("fold",), input_shapes={"x": (1, 8)})
    with pytest.raises(AttributeError):
        options.seq_len = 9  # frozen
    with pytest.raises(TypeError):
        options.input_shapes["y"] = (1,)  # read-only mapping
    assert options.replace(seq_len=16).seq_len == 16 and options.seq_len == 8
    with pytest.raises(InputError, match="option 'seq_len': expected an integer in 1..131072, got nan"):
        of({"seq_len": math.nan})
    assert of({"seq_len": MAX_LEN}).seq_len == MAX_LEN
    with pytest.raises(InputError, match="option 'no_such': unknown option"):
        of({"no_such": 1})


@pytest.mark.parametrize("flag, value, message", [
    ("--atol", "nan", "--atol: expected a finite number >= 0, got nan"),
    ("--rtol", "-1e-3", "--rtol: expected a finite number >= 0, got -0.001"),
    ("--min-cosine", "nan", "--min-cosine: expected a number in -1..1, got nan"),
    ("--min-cosine", "2", "--min-cosine: expected a number in -1..1, got 2.0"),
])
def test_verify_tolerances(capsys, tmp_path, flag, value, message):
    code, out, err = mtkc(capsys, "verify", tmp_path, f"{flag}={value}")
    assert (code, out, err) == (2, "", f"mtkc: error: {message}\n")
