"""Hostile inputs, round 3 (issue 22), part a: code execution, writes outside their folder,
untrusted calibration data, prompts and templates; and issue 24's convert.sh portability,
prompt errors naming what the user gave, and `generate` streaming decoded text.

Every case is built by code in its own folder of a shared arena and asserts the exit code, the
one-line stderr naming the culprit, empty stdout on exit 2, that nothing outside the case folder
changed, and that the marker file an injected command would create does not exist.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hostile_kit import assert_contract, calibrate_by_hand, make_tokenizer, run_cli, save, snapshot, tiny, with_cpu_node

from mtkc.backend import handoff
from mtkc.pipeline.calibrate import save_npz
from mtkc.pipeline.compile import compile_model
from mtkc.runtime import template

ROOT = Path(__file__).resolve().parent.parent
MARK = "PWNED"  # the file every injected command in this module would create


# ------------------------------------------------------------------ the arena and shared folders


@pytest.fixture(scope="module")
def arena(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("round3a")
    (root / "victim").mkdir()
    (root / "victim" / "secret.txt").write_text("do not touch")
    return root


@pytest.fixture
def case(arena, request):
    """The case folder; afterwards nothing outside it changed and no injected command ran."""
    folder = arena / re.sub(r"[^\w.-]", "_", request.node.name)
    folder.mkdir()
    before = snapshot(arena, skip=folder)
    yield folder
    assert snapshot(arena, skip=folder) == before  # nothing outside the case folder changed
    assert not list(arena.rglob(MARK)) and not (Path.cwd() / MARK).exists()


def expect2(result, says: str) -> None:
    assert_contract(result, 2, says)
    assert result.out == "", result.out  # exit 2: no data on stdout
    assert len(result.err.strip().splitlines()) >= 1


def inject(arena: Path) -> str:
    """Shell text that creates the marker file when a shell runs it."""
    return f"$(touch {arena}/{MARK})`touch {arena}/{MARK}`;touch {arena}/{MARK};\n touch {arena}/{MARK} #"


@pytest.fixture(scope="module")
def quant_base(tmp_path_factory) -> Path:
    """A compile of a tiny model (NPU, CPU, NPU partitions) with a hand-made calibration set."""
    root = tmp_path_factory.mktemp("qbase")
    model = save(with_cpu_node("hm"), root / "src" / "m.onnx")
    assert_contract(run_cli(["compile", model, "--sdk", "8.0", "-o", root / "out", "--no-convert"]), 0)
    calibrate_by_hand(root / "out")
    assert_contract(run_cli(["convert", root / "out", "--quant", "A16W8", "--no-convert"]), 0)  # the quantising convert.sh
    return root / "out"


@pytest.fixture(scope="module")
def llm_out(exported, tmp_path_factory) -> Path:
    """A KV-cache compile of the tiny Qwen2 export (vocabulary 1000), T = 8, C = 64."""
    folder = tmp_path_factory.mktemp("llm") / "out"
    compile_model(exported("qwen2", "legacy17", True), "8.0", folder,
                  {"seq_len": 8, "cache_len": 64, "kv_cache": True, "no_convert": True})
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), "{% for m in messages %}t7 {{ m['content'] }} {% endfor %}t9")


def copy(base: Path, d: Path) -> Path:
    shutil.copytree(base, d / "out")
    return d / "out"


def edit_manifest(out: Path, fn) -> None:
    path = out / "manifest.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def fake_sdk(d: Path) -> dict[str, str]:
    """MediaTek's SDK stood in for: a `mtk_converter` module that records what it got, an `ncc-tflite`."""
    (d / "site").mkdir()
    (d / "site" / "mtk_converter.py").write_text(
        "import json\n"
        "class OnnxConverter:\n"
        "    @classmethod\n"
        "    def from_model_proto_file(cls, path, input_names=None, input_shapes=None):\n"
        "        c = cls(); c.record = {'model': path, 'input_names': input_names, 'input_shapes': input_shapes}\n"
        "        return c\n"
        "    def convert_to_tflite(self, output_file, tflite_op_export_spec):\n"
        "        gen = getattr(self, 'calibration_data_gen', None)\n"
        "        self.record['samples'] = [[a.shape for a in s] for s in gen()] if gen else None\n"
        "        open(output_file, 'w').write(json.dumps(self.record, default=list))\n")
    (d / "bin").mkdir()
    (d / "bin" / "ncc-tflite").write_text(f"#!{sys.executable}\nimport sys; a = sys.argv\n"
                                          "open(a[a.index('-o') + 1], 'w').write(open(a[-3]).read())\n")
    (d / "bin" / "ncc-tflite").chmod(0o755)
    return {"PATH": f"{d / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(d / "site"), "MTKC_PYTHON": sys.executable,
            "HOME": str(d)}


def run_script(out: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", os.path.relpath(out / "convert.sh", cwd)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


# ------------------------------------------------------------------ code execution


def test_tokenizer_auto_map_is_refused_and_its_code_never_runs(case, arena, llm_out, monkeypatch):
    """Before: with `y` on stdin the folder's tokenizer code ran; without, transformers' question went to stdout."""
    folder = make_tokenizer(case / "tok", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (folder / "evil.py").write_text(f"open({str(arena / MARK)!r}, 'w').write('ran')\n"
                                    "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    for command in (["generate", llm_out, "--max-new-tokens", "1"], ["calibrate", llm_out]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
        r = run_cli([*command, "--prompt", "t5 t6", "--tokenizer", folder])
        expect2(r, f"{folder / 'tokenizer_config.json'}: `auto_map` names custom tokenizer code")


def test_config_auto_map_is_refused(case, llm_out):
    folder = make_tokenizer(case / "tok")
    (folder / "config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": "evil.T"}}))
    expect2(run_cli(["generate", llm_out, "--prompt", "t5", "--tokenizer", folder]), "config.json: `auto_map`")


@pytest.mark.parametrize("field", ["graph", "partition"])
def test_manifest_name_with_a_newline_never_reaches_convert_sh(case, arena, quant_base, field):
    """Before: a graph name or partition id holding a newline was written into convert.sh and ran."""
    out = copy(quant_base, case)
    script = (out / "convert.sh").read_bytes()
    evil = "model\n" + inject(arena) if field == "graph" else "npu0\n" + inject(arena)

    def rename(m):
        if field == "graph":
            m["graphs"][0]["name"] = evil
        else:
            m["graphs"][0]["partitions"][0]["id"] = evil
        return m

    edit_manifest(out, rename)
    r = run_cli(["convert", out, "--quant", "A16W8", "--no-convert"])
    expect2(r, "graphs[0].name: not a plain name" if field == "graph" else "graphs[0].partitions[0].id: not a plain name")
    assert (out / "convert.sh").read_bytes() == script  # nothing was written
    assert run_script(out, fake_sdk(case), case).returncode == 0  # the script left in OUT runs, and injects nothing


def test_writer_refuses_names_that_are_not_plain(case, arena):
    manifest = {"arch": "mdla5.3", "sdk": "8.0", "graphs": [{"name": f"g;{inject(arena)}", "partitions": [
        {"id": "npu0", "target": "npu", "path": "m.onnx", "inputs": [{"name": "x", "shape": [1]}]}]}]}
    with pytest.raises(handoff.InputError, match="is not a plain name"):
        handoff.run(case, manifest, converter_cmd="conv {input} {output}", no_convert=True)
    assert not (case / "convert.sh").exists()


HOSTILE_INPUT = "x'\"; $(touch PWNED) `touch PWNED` a,b:c \\ {}\t*?"  # a tensor name: free text in ONNX


def _quant_out(root: Path, x: str) -> Path:
    model = save(tiny(x=x), root / "src" / "m.onnx")
    assert_contract(run_cli(["compile", model, "--sdk", "8.0", "-o", root / "out", "--no-convert"]), 0)
    calibrate_by_hand(root / "out")
    assert_contract(run_cli(["convert", root / "out", "--quant", "A16W8", "--no-convert"]), 0)
    return root / "out"


@pytest.fixture(scope="module")
def hostile_quant_out(tmp_path_factory) -> Path:
    """A calibrated compile whose NPU partition input is named HOSTILE_INPUT (quotes, $(), backticks, a comma)."""
    return _quant_out(tmp_path_factory.mktemp("hostile-names"), HOSTILE_INPUT)


def _lex(script: str) -> list[str]:
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def test_convert_sh_quotes_every_value(hostile_quant_out, tmp_path):
    """convert.sh lexes (shlex, shell punctuation split off) into exactly the words and operators of
    the same script for a plain name: the hostile tensor name added no shell syntax, it is one word."""
    script = (hostile_quant_out / "convert.sh").read_text()
    words, plain = _lex(script), _lex((_quant_out(tmp_path, "x") / "convert.sh").read_text())
    assert len(words) == len(plain)
    differ = [(a, b) for a, b in zip(words, plain) if a != b]
    assert differ and all(b == '["x"]' and json.loads(a) == [HOSTILE_INPUT] for a, b in differ), differ
    at = next(k for k, w in enumerate(words) if w == "$PYTHON" and words[k + 1] == "-c" and "OnnxConverter" in words[k + 2])
    assert json.loads(words[at + 5]) == [HOSTILE_INPUT]  # the name arrives whole, as one word
    assert sys.executable not in script  # no interpreter of the writing environment


def test_hostile_input_name_arrives_whole_and_runs_nothing(hostile_quant_out, case):
    out = copy(hostile_quant_out, case)
    env = fake_sdk(case)
    proc = run_script(out, env, case)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "convert.sh: converted 1 partition(s)" in proc.stderr
    record = json.loads((out / "dla" / "model.npu0.dla").read_text())
    assert record["input_names"] == [HOSTILE_INPUT] and record["samples"] == [[[1, 4]], [[1, 4]]]
    assert not (case / MARK).exists() and not (out / MARK).exists()


def test_comma_in_an_input_name_with_input_names_placeholder_is_refused(hostile_quant_out, case):
    """Before: a comma split one name into two converter arguments (exit 3)."""
    out = copy(hostile_quant_out, case)
    r = run_cli(["convert", out, "--quant", "A16W8", "--converter-cmd", "conv {input} {output} {input_names}"])
    expect2(r, "holds a comma, which {input_names} cannot carry")


def test_cdpath_does_not_move_convert_sh(case, quant_base):
    """Before: `CDPATH` made convert.sh `cd` into another folder of the same name and write there."""
    out = copy(quant_base, case)
    assert_contract(run_cli(["convert", out, "--quant", "A16W8", "--no-convert"]), 0)
    decoy = case / "decoy"
    (decoy / "out").mkdir(parents=True)
    env = {**fake_sdk(case), "CDPATH": str(decoy)}
    proc = run_script(out, env, case)
    assert proc.returncode == 0, proc.stderr
    assert list((decoy / "out").iterdir()) == [] and (out / "dla" / "model.npu0.dla").is_file()


def test_convert_sh_checks_its_requirements_first(case, quant_base):
    """Issue 24: python3 or $MTKC_PYTHON, mtk_converter checked first with a clear message on stderr."""
    out = copy(quant_base, case)
    r = run_cli(["convert", out, "--quant", "A16W8"], cwd=case)
    assert_contract(r, 0)
    assert r.out == "" and "mtkc: not converted" in r.err and "mtk_converter" in r.err
    env = {**fake_sdk(case), "PYTHONPATH": ""}  # a python without mtk_converter
    proc = run_script(out, env, case)
    assert proc.returncode == 127 and proc.stdout == ""
    assert proc.stderr.strip() == (f"convert.sh: {sys.executable} cannot import mtk_converter (MediaTek NeuroPilot "
                                   "SDK); install it or set MTKC_PYTHON")
    assert not (out / "dla").exists()
    env = {"PATH": str(case / "nothing-here"), "HOME": str(case)}  # no python3, no $MTKC_PYTHON
    proc = subprocess.run(["/bin/sh", str(out / "convert.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 127 and proc.stderr == "convert.sh: python3 not found (set MTKC_PYTHON)\n"


def test_no_trust_remote_code_no_pickles_in_the_package():
    sources = [p for folder in ("compiler", "passes", "opsets") for p in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 50
    for path in sources:
        text = path.read_text()
        for m in re.finditer(r"trust_remote_code\s*=\s*(\w+)", text):
            assert m[1] == "False", f"{path}: {m[0]}"
        assert not re.search(r"allow_pickle\s*=\s*True", text), path


# ------------------------------------------------------------------ writes outside their folder


def test_convert_quant_partition_id_escaping_out(case, quant_base):
    """Before: id `../sub/ESCAPED` wrote ESCAPED.log and ESCAPED.dla outside OUT (exit 0)."""
    out = copy(quant_base, case)
    (case / "sub").mkdir()
    edit_manifest(out, lambda m: {**m, "graphs": [{**m["graphs"][0], "partitions": [
        {**m["graphs"][0]["partitions"][0], "id": "../../sub/ESCAPED"}] + m["graphs"][0]["partitions"][1:]}]})
    cmd = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'w').write('x')\" {{output}}"
    expect2(run_cli(["convert", out, "--quant", "A16W8", "--converter-cmd", cmd]), "partitions[0].id: not a plain name")
    assert list((case / "sub").iterdir()) == []


def test_verify_quant_partition_id_escaping_its_temp_folder(case, quant_base):
    """Before: verify --quant wrote `*.float.onnx` / `*.A16W8.onnx` outside its temporary folder."""
    out = copy(quant_base, case)
    edit_manifest(out, lambda m: {**m, "graphs": [{**m["graphs"][0], "name": "../../../ESCAPED"}]})
    expect2(run_cli(["verify", out, "--quant", "A16W8"]), "graphs[0].name: not a plain name")


@pytest.mark.parametrize("entry,says", [
    ({"path": "/tmp", "index": "calibration/index.json"}, "calibration.path: '/tmp' is not 'calibration'"),
    ({"path": "../victim", "index": "calibration/index.json"}, "calibration.path: '../victim' is not 'calibration'"),
    ({"path": "calibration", "index": "../victim/secret.txt"}, "calibration.index: '../victim/secret.txt'"),
    ({"path": "calibration", "index": "calibration/index.json", "ranges": "/etc/passwd"}, "calibration.ranges"),
])
def test_calibration_entries_leaving_out(case, quant_base, entry, says):
    """Before: absolute and `..` calibration entries were followed (exit 1 or 0)."""
    out = copy(quant_base, case)
    edit_manifest(out, lambda m: {**m, "calibration": {**m["calibration"], **entry}})
    for command in (["convert", out, "--quant", "A16W8", "--no-convert"], ["verify", out, "--quant", "A16W8"]):
        expect2(run_cli(command), says)


def test_calibration_folder_symlinked_out_of_out(case, quant_base, arena):
    out = copy(quant_base, case)
    shutil.move(out / "calibration", case / "elsewhere")
    (out / "calibration").symlink_to(case / "elsewhere")
    for command in (["convert", out, "--quant", "A16W8", "--no-convert"], ["verify", out, "--quant", "A16W8"]):
        expect2(run_cli(command), f"{out / 'calibration'}: is a symlink")


# ------------------------------------------------------------------ untrusted calibration data


def _sample(out: Path) -> Path:
    return out / "calibration" / "model.npu0" / "0000.npz"


def _pickled(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z, z.open("x.npy", "w") as f:
        np.lib.format.write_array(f, np.array([{"evil": 1}], dtype=object), allow_pickle=True)


SAMPLES = {  # before: each was exit 4 (or used as is)
    "pickled-object": (_pickled, "input 'x': holds Python objects (a pickle)"),
    "wrong-keys": (lambda p: save_npz(p, {"y": np.zeros((1, 64), np.float32)}), "expected the partition's inputs ['x']"),
    "extra-key": (lambda p: save_npz(p, {"x": np.zeros((1, 64), np.float32), "z": np.zeros(1)}), "unexpected ['z']"),
    "wrong-shape": (lambda p: save_npz(p, {"x": np.zeros((1, 63), np.float32)}), "input 'x': shape [1, 63], expected [1, 64]"),
    "wrong-dtype": (lambda p: save_npz(p, {"x": np.zeros((1, 64), np.int64)}), "input 'x': dtype int64, expected float32"),
    "nan": (lambda p: save_npz(p, {"x": np.full((1, 64), np.nan, np.float32)}), "input 'x': holds NaN or Inf"),
    "inf": (lambda p: save_npz(p, {"x": np.full((1, 64), np.inf, np.float16)}), "input 'x': holds NaN or Inf"),
    "symlink-to-passwd": (lambda p: (p.unlink(), p.symlink_to("/etc/passwd")), "calibration sample is a symlink"),
    "not-a-zip": (lambda p: p.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n"), "is not an .npz archive"),
    "a-directory": (lambda p: (p.unlink(), p.mkdir()), "calibration sample is a folder"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), "0000.npz"),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_untrusted_calibration_sample(case, quant_base, name):
    out = copy(quant_base, case)
    make, says = SAMPLES[name]
    make(_sample(out))
    r = run_cli(["convert", out, "--quant", "A16W8", "--no-convert"])
    expect2(r, says)
    assert str(_sample(out)) in r.err or "calibration/model.npu0" in r.err


def test_float16_sample_of_a_float32_input_is_accepted(case, quant_base):
    """quantscale stores float32 inputs as float16: the loader casts them back."""
    from mtkc.backend.calibration_data import read_sample

    out = copy(quant_base, case)
    save_npz(_sample(out), {"x": np.full((1, 64), 0.5, np.float16)})
    value = read_sample(_sample(out), [{"name": "x", "dtype": "float32", "shape": [1, 64]}])["x"]
    assert value.dtype == np.float32 and float(value[0, 0]) == 0.5
    assert_contract(run_cli(["convert", out, "--quant", "A16W8", "--no-convert"]), 0)


@pytest.mark.parametrize("entry,says", [
    ([1, 2], "calibration: expected an object"),
    ("calibration", "calibration: expected an object"),
    ({"path": 7, "index": "calibration/index.json"}, "calibration.path: expected the string 'calibration', not int"),
    ({"path": "calibration", "index": None}, "calibration.index: expected the string"),
])
def test_calibration_entry_of_the_wrong_shape(case, quant_base, entry, says):
    out = copy(quant_base, case)
    edit_manifest(out, lambda m: {**m, "calibration": entry})
    expect2(run_cli(["convert", out, "--quant", "A16W8", "--no-convert"]), says)


@pytest.mark.parametrize("index,says", [
    ("{oops", "cannot read the calibration index (JSONDecodeError)"),
    (json.dumps({"prompts": [{"ids": ["a"]}]}), "prompts[0].ids: expected a non-empty list"),
    (json.dumps({"prompts": "x"}), "prompts: expected a non-empty list"),
    ("[" * 100000 + "]" * 100000, "cannot read the calibration index"),
], ids=["not-json", "ids-not-ints", "prompts-not-a-list", "deep-nesting"])
def test_calibration_index_is_untrusted(case, quant_base, index, says):
    out = copy(quant_base, case)
    (out / "calibration" / "index.json").write_text(index)
    expect2(run_cli(["verify", out, "--quant", "A16W8"]), says)


def test_verify_quant_reads_samples_through_the_loader(case, llm_out):
    """The quantisation simulation's calibration reader refuses a NaN sample (exit 2, not 4)."""
    from mtkc.pipeline.calibrate import calibrate
    from mtkc.runtime.prompts import Prompt

    out = copy(llm_out, case)
    calibrate(out, [Prompt([3, 9, 27]), Prompt(list(range(10, 21)))], 1)
    sample = sorted((out / "calibration" / "prefill.npu0").glob("*.npz"))[0]
    with np.load(sample) as data:
        arrays = {k: data[k] for k in data.files}
    name = next(k for k, v in arrays.items() if v.dtype.kind == "f")  # float32 inputs may be stored as float16
    arrays[name] = np.full_like(arrays[name], np.nan)
    save_npz(sample, arrays)
    expect2(run_cli(["verify", out, "--quant", "A16W8", "--new-tokens", "1"]), f"input '{name}': holds NaN or Inf")


# ------------------------------------------------------------------ prompts


def _prompts(d: Path, data: bytes, name: str = "p.jsonl") -> Path:
    (d / name).write_bytes(data)
    return d / name


def test_bom_jsonl_is_read_as_jsonl(case, llm_out, tokenizer_dir):
    """Before: a BOM made the file text: calibrated on ids [0, 0, 0] with exit 0."""
    out = copy(llm_out, case)
    path = _prompts(case, b'\xef\xbb\xbf{"ids": [5, 6, 7]}\n{"ids": [8, 9, 10, 11]}\n', "p.txt")
    r = run_cli(["calibrate", out, "--prompts", path, "--tokenizer", tokenizer_dir, "--decode-steps", "1"])
    assert_contract(r, 0)
    index = json.loads((out / "calibration" / "index.json").read_text())
    assert [p["ids"] for p in index["prompts"]] == [[5, 6, 7], [8, 9, 10, 11]]


PROMPT_FILES = {  # before: exit 4 (or text, or the kernel's OOM killer at 4 GB)
    "bad-json-line": (b'{"ids": [1, 2]}\n{"ids": [1, 2\n', "p.jsonl:2: not valid JSON"),
    "deep-nesting": (b'{"ids": ' + b"[" * 1000 + b"]" * 1000 + b"}\n", "p.jsonl:1: JSON nested deeper than 8 levels"),
    "huge-id": (b'{"ids": [' + b"9" * 5000 + b"]}\n", "p.jsonl:1: integer of 5000 digits"),
    "id-past-2^31": (b'{"ids": [2147483648]}\n', "p.jsonl:1: `ids` must be a non-empty list of integers in 0..2^31-1"),
    "lone-surrogate": (b'{"text": "a \\ud800 b"}\n', "p.jsonl:1: the text holds a lone surrogate (\\ud800)"),
    "nan-id": (b'{"ids": [NaN]}\n', "p.jsonl:1: NaN is not a token id"),
    "not-utf8": (b"t1 t2\n\xff\xfe\n", "p.jsonl:2: not UTF-8 text"),
    "nul-bytes": (b"t1\0t2\n", "p.jsonl:1: holds a NUL byte"),
    "json-array-line": (b'{"ids": [1]}\n[1, 2]\n', "p.jsonl:2: expected a JSON object"),
}


@pytest.mark.parametrize("name", sorted(PROMPT_FILES))
def test_hostile_prompt_file(case, llm_out, tokenizer_dir, name):
    data, says = PROMPT_FILES[name]
    path = _prompts(case, data)
    for command in ("generate", "calibrate"):
        expect2(run_cli([command, llm_out, "--prompts", path, "--tokenizer", tokenizer_dir]), f"{path}:" + says.split(":", 1)[1])


def test_dev_zero_and_a_50_mb_line_are_bounded(case, llm_out):
    """Before: /dev/zero exit 4; a 50 MB single line grew the process to 4 GB."""
    import resource

    expect2(run_cli(["generate", llm_out, "--prompts", "/dev/zero"]), "/dev/zero: larger than 64 MiB")
    big = _prompts(case, b"t1 " * ((50 << 20) // 3), "big.txt")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expect2(run_cli(["generate", llm_out, "--prompts", big]), f"{big}:1: the line is longer than 1 MiB")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 400 << 10  # KiB: under 400 MB more


def test_ids_outside_the_vocabulary_name_the_file_line(case, llm_out):
    path = _prompts(case, b'{"ids": [5, 6]}\n\n{"ids": [5, 5000]}\n')
    for command in ("generate", "calibrate"):
        expect2(run_cli([command, llm_out, "--prompts", path]), f"{path}:3: token id 5000 is outside the vocabulary (0..999)")
    assert not (llm_out / "calibration").exists()


def test_text_prompt_errors_name_the_option_not_prompt_ids(case, llm_out, tokenizer_dir):
    """Issue 24. Before: `--prompt-ids: token id 1367 is outside the vocabulary` after `--prompt TEXT`."""
    r = run_cli(["generate", llm_out, "--prompt", "t5 t1500", "--tokenizer", tokenizer_dir])
    expect2(r, "--prompt: token id 1500 (from the --tokenizer's encoding) is outside the vocabulary (0..999)")
    assert "--prompt-ids" not in r.err
    path = _prompts(case, b"t5 t6\nt7 t1999\n", "p.txt")
    expect2(run_cli(["generate", llm_out, "--prompts", path, "--tokenizer", tokenizer_dir]), f"{path}:2: token id 1999")


# ------------------------------------------------------------------ chat templates


TEMPLATES = {  # before: exit 4 (and 57 s / 2.4 GB for the exponential one)
    "raises": ("{{ raise_exception('no system role allowed') }}", "fails: TemplateError: no system role allowed"),
    "syntax-error": ("{% for m in messages %}{{ m.content }}", "fails: syntax error at line 1"),
    "undefined-call": ("{{ nothing() }}", "the chat template fails: UndefinedError"),
    "ssti-os-system": ("{{ cycler.__init__.__globals__.os.system('touch " + MARK + "') }}", "the chat template fails"),
    "ssti-subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template fails"),
    "ssti-format": ("{{ '{0.__class__.__init__.__globals__}'.format(cycler) }}", "the sandbox refused it"),
    "string-bomb": ("{% set a = 'x' * 100000 %}{{ a * 100000 }}", "the chat template fails: it needs more than 256 MiB"),
    "doubling": ("{% set ns = namespace(v='ab') %}{% for i in range(60) %}{% set ns.v = ns.v ~ ns.v %}{% endfor %}"
                 "{{ ns.v }}", "the chat template"),
    "long-output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "renders more than 4 Mi characters"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_hostile_chat_template(case, llm_out, name, monkeypatch):
    source, says = TEMPLATES[name]
    folder = make_tokenizer(case / "tok", source)
    where = folder / "chat_template.jinja"
    if not where.is_file():
        where = folder / "tokenizer_config.json"
    monkeypatch.chdir(case)  # an injected relative `touch` would land here
    start = time.monotonic()
    r = run_cli(["generate", llm_out, "--prompt", "t5", "--tokenizer", folder, "--chat-template"])
    expect2(r, f"{where}: ")
    assert says in r.err and time.monotonic() - start < 20
    assert not (case / MARK).exists()


def test_chat_template_cpu_bound(case, llm_out, monkeypatch):
    """A template that loops for ever is ended by the renderer's bounds."""
    monkeypatch.setattr(template, "CPU_SECONDS", 1)
    monkeypatch.setattr(template, "TIMEOUT", 3.0)
    folder = make_tokenizer(case / "tok", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    start = time.monotonic()
    r = run_cli(["generate", llm_out, "--prompt", "t5", "--tokenizer", folder, "--chat-template"])
    expect2(r, "the chat template")
    assert time.monotonic() - start < 10


def test_chat_template_renders_in_the_sandbox(case, llm_out, tokenizer_dir):
    path = _prompts(case, b'{"text": "t5 t6"}\n', "p.jsonl")
    r = run_cli(["generate", llm_out, "--prompts", path, "--tokenizer", tokenizer_dir, "--chat-template",
                 "--format", "json", "--max-new-tokens", "2"])
    assert_contract(r, 0)
    reference = run_cli(["generate", llm_out, "--prompt-ids", "7,5,6,9", "--format", "json", "--max-new-tokens", "2"])
    assert json.loads(r.out)["tokens"] == json.loads(reference.out)["tokens"]


# ------------------------------------------------------------------ generate prints text, streaming


def test_generate_prints_decoded_text_and_streams(case, llm_out, tokenizer_dir, monkeypatch):
    """Issue 24: with --tokenizer, generate prints the decoded text (ids in --format json), token by token."""
    from transformers import AutoTokenizer

    r = run_cli(["generate", llm_out, "--prompt", "t5 t6 t7", "--tokenizer", tokenizer_dir, "--format", "json",
                 "--max-new-tokens", "5"])
    assert_contract(r, 0)
    item = json.loads(r.out)
    ids = run_cli(["generate", llm_out, "--prompt-ids", "5,6,7", "--format", "json", "--max-new-tokens", "5"])
    assert item["tokens"] == json.loads(ids.out)["tokens"] and len(item["tokens"]) == 5
    decoded = AutoTokenizer.from_pretrained(tokenizer_dir).decode(item["tokens"], skip_special_tokens=True)
    assert item["text"] == decoded and decoded

    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Recorder())
    from mtkc.cli import main

    assert main(["generate", str(llm_out), "--prompt", "t5 t6 t7", "--tokenizer", str(tokenizer_dir),
                 "--max-new-tokens", "5"]) == 0
    assert "".join(writes) == decoded + "\n"
    shown = [t for t in item["tokens"] if t != 0]  # t0 is the unknown token: decoded to nothing
    assert len([w for w in writes if w.strip()]) == len(shown)  # one write per token: streamed, not at the end
    writes.clear()
    assert main(["generate", str(llm_out), "--prompt-ids", "5,6,7", "--max-new-tokens", "5"]) == 0
    assert "".join(writes) == " ".join(map(str, item["tokens"])) + "\n"
