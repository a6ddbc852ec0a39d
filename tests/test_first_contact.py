"""Issue 13, first contact: the design card's command verbatim, `check` agreeing with `compile`,
plugin docs that work when followed, and a terminal that says what happened."""

from __future__ import annotations

import json
import shutil
import textwrap

import onnx
import pytest

from mtkc import cli
from mtkc.pipeline.compile import default_output


def mtkc(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def static(shape) -> bool:
    return all(isinstance(d, int) and d > 0 for d in shape)


@pytest.mark.parametrize("cache", [False, True])
def test_the_verbatim_command(run_cli, exported, tmp_path, cache):
    """`mtkc compile model.onnx --sdk 7.0` in a fresh folder: one new output folder, every graph and
    partition static at the announced sizes, 100 % NPU on SDK 7.0."""
    for f in exported("qwen2", "legacy17", cache=cache).parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    before = {p.name for p in tmp_path.iterdir()}
    code, out, err = run_cli("compile", "model.onnx", "--sdk", "7.0", cwd=tmp_path)
    assert code == 0, err
    (made,) = {p.name for p in tmp_path.iterdir()} - before
    assert made == "model.mtkc-7.0" and f"output folder {made}" in err
    lines = err.strip().splitlines()
    bound = "seq_len=128, cache_len=512, batch=1" if cache else "seq_len=128, batch=1"
    assert [line for line in lines if "LLM defaults" in line] == [
        f"mtkc: bound dims the options left open to MediaTek's LLM defaults: {bound} "
        f"(set {'--seq-len/--cache-len/--batch' if cache else '--seq-len/--batch'} to choose)"]
    assert lines[-1].startswith("mtkc: no converter ran (")
    manifest = json.loads((tmp_path / made / "manifest.json").read_text())
    options = manifest["options"]
    assert (options["seq_len"], options["batch"], options.get("cache_len")) == (128, 1, 512 if cache else None)
    if cache:  # the 640-row RoPE table is a host Gather on SDK 7.0 (limit 512): pos_emb is picked and said
        assert options["rope_mode"] == "pos_emb" and any(line.startswith("mtkc: picked rope_mode=pos_emb") for line in lines)
    assert manifest["coverage"]["placed"] == 1.0
    for graph in manifest["graphs"]:
        assert all(static(t["shape"]) for t in graph["inputs"] + graph["outputs"])
        for part in graph["partitions"]:
            assert part["target"] == "npu"
            model = onnx.load(tmp_path / made / part["path"], load_external_data=False)
            for t in list(model.graph.input) + list(model.graph.output):
                assert static([d.dim_value for d in t.type.tensor_type.shape.dim]), (part["path"], t.name)
    assert out == ""


def test_default_output_never_reuses_a_name(tmp_path):
    assert default_output("x/model.onnx", "7.0", tmp_path) == tmp_path / "model.mtkc-7.0"
    (tmp_path / "model.mtkc-7.0").mkdir()
    (tmp_path / "model.mtkc-7.0-2").write_text("someone's file")
    assert default_output("model.onnx", "7.0", tmp_path) == tmp_path / "model.mtkc-7.0-3"


CASES = [("qwen2", "legacy17", False, "7.0", []), ("qwen2", "legacy17", True, "7.0", []),
         ("llama", "dynamo", True, "8.0", ["--seq-len", "8", "--cache-len", "16"]),
         ("qwen2", "hf", False, "6.0", ["--seq-len", "8"]),
         ("qwen2", "legacy17", False, "8.0", ["--passes", "bind-shapes,fold", "--seq-len", "8"]),
         ("llama", "legacy17", False, "8.0", ["--seq-len", "8", "--force-cpu", "op:Softmax"])]


@pytest.mark.parametrize("family, exporter, cache, sdk, flags", CASES)
def test_check_says_what_compile_writes(capsys, exported, tmp_path, family, exporter, cache, sdk, flags):
    model = exported(family, exporter, cache=cache)
    code, out, err = mtkc(capsys, "check", model, "--sdk", sdk, "--format", "json", *flags)
    assert code == 0, err
    report = json.loads(out)
    strict = mtkc(capsys, "check", model, "--sdk", sdk, "--strict", *flags)[0]
    code, _, err = mtkc(capsys, "compile", model, "--sdk", sdk, "-o", tmp_path / "out", *flags)
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    parts = [p for g in manifest["graphs"] for p in g["partitions"]]
    on_cpu = any(p["target"] != "npu" for p in parts)
    assert (report["strict"], strict) == (("fail", 1) if on_cpu else ("pass", 0))
    assert report["partitions"] == len(parts)
    assert [g["name"] for g in report["graphs"]] == [g["name"] for g in manifest["graphs"]]
    for summary, graph in zip(report["graphs"], manifest["graphs"]):
        npu = [len(p["nodes"]) for p in graph["partitions"] if p["target"] == "npu"]
        assert summary["largest_npu"] == max(npu, default=0)
        assert summary["cpu_nodes"] == sum(len(p["nodes"]) for p in graph["partitions"] if p["target"] != "npu")
    assert report["bound"] == {k: manifest["options"][k] for k in report["bound"]}
    if not on_cpu:
        assert report["verdict"] == "GOOD"


def test_check_json_leads_with_the_compile_outcome(capsys, exported):
    code, out, _ = mtkc(capsys, "check", exported("qwen2", "legacy17", cache=True), "--sdk", "7.0", "--format", "json")
    report = json.loads(out)
    assert code == 0 and (report["verdict"], report["strict"], report["partitions"]) == ("GOOD", "pass", 2)
    assert report["unbound"] == ["batch_size", "past_sequence_length", "sequence_length", "total_sequence_length"]
    assert report["bound"] == {"seq_len": 128, "cache_len": 512, "batch": 1}
    assert report["picked"]["rope_mode"].startswith("pos_emb: ") and report["on_cpu"] == [] and not report["suggested"]
    assert all(g["detail"] for g in report["unsupported"])
    code, text, _ = mtkc(capsys, "check", exported("qwen2", "legacy17", cache=True), "--sdk", "7.0")
    first = text.splitlines()[2]
    assert first.startswith("verdict     GOOD after compile's pipeline") and " detail " in text


def test_check_names_the_option_that_fixes_what_compile_leaves_on_the_cpu(capsys, exported):
    model = exported("qwen2", "legacy17", cache=True)
    code, out, _ = mtkc(capsys, "check", model, "--sdk", "7.0", "--rope-mode", "table", "--format", "json", "--strict")
    report = json.loads(out)
    assert code == 1 and report["strict"] == "fail" and report["picked"] == {}
    assert {c["reason"].split(":")[0] for c in report["on_cpu"]} == {"host-op"}
    assert len(report["on_cpu"]) == sum(g["cpu_nodes"] for g in report["graphs"]) == 4
    assert report["suggested"]["rope_mode"].startswith("pos_emb: the table mode leaves 2 nodes of 'prefill'")
    code, text, _ = mtkc(capsys, "check", model, "--sdk", "7.0", "--rope-mode", "table")
    assert "remedy      --rope-mode pos_emb: " in text and "on CPU      prefill: " in text


def test_a_directory_is_not_a_model(capsys, tmp_path):
    for command in ("check", "compile"):
        code, _, err = mtkc(capsys, command, tmp_path, "--sdk", "7.0", *(["-o", tmp_path / "o"] if command == "compile" else []))
        assert code == 2 and err.strip() == f"mtkc: error: {tmp_path}: is a directory; give the model's .onnx file"


PLUGIN = '''
from mtkc.rewrite.pass_api import Miss, Pass, PassResult, register

@register
class Documented(Pass):
    name = "documented"
    description = "records a refusal and a note, as the README shows"
    after = AFTER

    def run(self, graph, ctx):
        result = PassResult()
        for node in [n for n in graph.nodes if n.op == "Softmax"][:1]:
            result.misses.append(Miss(node, "kept: test plugin"))
        result.notes.append("looked at the Softmax nodes")
        if RAISE:
            raise ValueError("plugin bug")
        return result
'''


def plugin(tmp_path, after="'fold'", raises=False):
    path = tmp_path / "documented.py"
    path.write_text(textwrap.dedent(PLUGIN).replace("AFTER", after).replace("RAISE", str(raises)))
    return path


def test_plugin_as_documented(capsys, exported, tmp_path):
    model = exported("qwen2", "legacy17")
    code, _, err = mtkc(capsys, "compile", model, "--sdk", "8.0", "--seq-len", "8", "--plugin", plugin(tmp_path),
                        "-o", tmp_path / "out", "--explain", "documented")
    assert code == 0, err
    report = (tmp_path / "out" / "report.md").read_text()
    assert "`documented` (model): looked at the Softmax nodes" in report
    passes = json.loads((tmp_path / "out" / "report.json").read_text())["passes"]
    (entry,) = [p for p in passes if p["name"] == "documented"]
    assert entry["misses"][0]["reason"] == "kept: test plugin" and isinstance(entry["misses"][0]["node"], str)


def test_plugin_after_no_pass_lists_the_names(capsys, exported, tmp_path):
    code, _, err = mtkc(capsys, "compile", exported("qwen2", "legacy17"), "--sdk", "8.0", "--seq-len", "8",
                        "--plugin", plugin(tmp_path, after="'flod'"), "-o", tmp_path / "out")
    assert code == 2 and "after = 'flod' names no pass; passes: " in err and "fold" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_plugin_exception_shows_file_and_line_with_v(capsys, exported, tmp_path):
    path = plugin(tmp_path, raises=True)
    args = ("compile", exported("qwen2", "legacy17"), "--sdk", "8.0", "--seq-len", "8", "--plugin", path,
            "-o", tmp_path / "out")
    code, _, err = mtkc(capsys, *args)
    assert code == 2 and err.rstrip().endswith("raised in run: ValueError: plugin bug") and "(at " not in err
    code, _, err = mtkc(capsys, *args, "-v")
    line = PLUGIN.splitlines().index('            raise ValueError("plugin bug")') + 1
    assert code == 2 and f"(at {path}:{line})" in err
