"""`mtkc compile`: whole-graph output, manifest, atomic/deterministic writes, plugins, config, CLI."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from mtkc.errors import InputError, MismatchError
from mtkc.ir import execute
from mtkc.ir.model import load
from mtkc.passes.pipelines import default_pipeline
from mtkc.pipeline.compile import compile_model
from mtkc.target.capability import load_table

SDK = "8.0"
STABLE = ["bind-shapes", "fold", "rmsnorm", "swiglu"]  # keep the I/O contract: outputs comparable as is
PLUGINS = "tests/plugins"
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def source(exported) -> Path:
    return exported("qwen2", "legacy17")


def cli(capsys, *args, cwd: Path | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """`mtkc ARGS` in this process (exit code, stdout, stderr); relative paths from `cwd` (default: repo)."""
    from mtkc.cli import main

    capsys.readouterr()
    if monkeypatch is not None:
        monkeypatch.chdir(cwd or ROOT)
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_compile_writes_a_runnable_graph_equal_to_the_original(source, tmp_path):
    out = tmp_path / "out"
    result = compile_model(source, SDK, out, {"seq_len": 8, "passes": STABLE})
    assert {"manifest.json", "model.onnx", "report.json", "weights.bin"} <= set(files(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result.manifest
    assert {"schema_version", "sdk", "arch", "options", "graphs", "coverage", "passes"} <= set(manifest)
    assert (manifest["sdk"], manifest["arch"], manifest["options"]["seq_len"]) == (SDK, load_table(SDK).arch, 8)
    [graph] = manifest["graphs"]
    assert (graph["name"], graph["path"]) == ("model", "model.onnx")
    assert graph["inputs"] == [{"name": "input_ids", "dtype": "int64", "shape": [1, 8]},
                               {"name": "attention_mask", "dtype": "int64", "shape": [1, 8]}]
    assert graph["outputs"][0]["name"] == "logits" and graph["outputs"][0]["shape"][:2] == [1, 8]
    assert [p["name"] for p in manifest["passes"]] == STABLE
    assert set(manifest["passes"][0]) == {"graph", "name", "rewrites", "nodes_before", "nodes_after"}
    assert 0 <= manifest["coverage"]["raw"] < manifest["coverage"]["compiled"] <= 1
    assert str(tmp_path) not in (out / "manifest.json").read_text()

    compiled, original = load(out / "model.onnx"), load(source)
    assert len(compiled.graph.nodes) < len(original.graph.nodes)
    feeds = execute.seeded_inputs(compiled.graph, 0)
    got = execute.run(compiled.graph, feeds, compiled.root)["logits"]
    want = execute.run(original.graph, feeds, original.root)["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_rerun_is_byte_identical_and_overwrite_is_explicit(source, tmp_path):
    options = {"seq_len": 8, "passes": STABLE}
    compile_model(source, SDK, tmp_path / "a", options)
    compile_model(source, SDK, tmp_path / "b", options)
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    report_a, report_b = json.loads(a.pop("report.json")), json.loads(b.pop("report.json"))
    assert a == b
    for report in (report_a, report_b):
        for entry in report["passes"]:
            assert entry.pop("seconds") >= 0
    assert report_a == report_b

    with pytest.raises(InputError, match="exists; pass --overwrite to replace it"):
        compile_model(source, SDK, tmp_path / "a", {**options, "passes": ["fold"]})
    assert files(tmp_path / "a") == {**a, "report.json": (tmp_path / "a" / "report.json").read_bytes()}
    compile_model(source, SDK, tmp_path / "a", {**options, "passes": ["fold"], "overwrite": True})
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["passes"][0]["name"] == "fold"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no staging left behind


def test_output_may_not_overlap_the_input(source, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(source.parent, model_dir)
    for out in (model_dir, tmp_path):
        with pytest.raises(InputError, match="output folder overlaps the input model"):
            compile_model(model_dir / "model.onnx", SDK, out, {"passes": ["fold"], "overwrite": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_failing_pass_writes_nothing(source, tmp_path):
    options = {"passes": ["negate-output"], "plugins": [f"{ROOT}/{PLUGINS}/negate_output.py"], "verify_each": True}
    with pytest.raises(MismatchError, match="pass 'negate-output' changed the numbers: output 'logits'"):
        compile_model(source, SDK, tmp_path / "out", options)
    assert list(tmp_path.iterdir()) == []


# --- CLI ------------------------------------------------------------------------------------


def test_cli_plugin_is_listed_and_runs(capsys, monkeypatch, source, tmp_path):
    plugin = f"{PLUGINS}/strip_identity.py"
    code, out, err = cli(capsys, "passes", "--sdk", SDK, "--plugin", plugin, "--format", "json", monkeypatch=monkeypatch)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["passes"]}
    assert rows["strip-identity"] == {"name": "strip-identity", "origin": f"plugin {plugin}", "applies": True,
                                      "default": True, "description": "bypass Identity nodes (test plugin)"}
    assert rows["fold"]["origin"] == "built-in"
    code, out, err = cli(capsys, "compile", source, "--sdk", SDK, "--seq-len", "8", "--plugin", plugin,
                         "--passes", "bind-shapes,fold,strip-identity", "-o", tmp_path / "out")
    assert code == 0, err
    passes = json.loads((tmp_path / "out" / "manifest.json").read_text())["passes"]
    assert [p["name"] for p in passes] == ["bind-shapes", "fold", "strip-identity"]


@pytest.mark.parametrize(
    "plugin, code, message",
    [
        ("negate_output", 1, "mtkc: error: --verify-each: pass 'negate-output' changed the numbers: output 'logits'"),
        ("import_error", 2, f"mtkc: error: plugin {PLUGINS}/import_error.py failed to import: ModuleNotFoundError"),
    ],
)
def test_cli_bad_plugins_are_named_and_nothing_is_written(capsys, monkeypatch, source, tmp_path, plugin, code, message):
    names = {"negate_output": "negate-output", "import_error": "fold"}
    got, out, err = cli(capsys, "compile", source, "--sdk", SDK, "--verify-each", "--plugin", f"{PLUGINS}/{plugin}.py",
                        "--passes", names[plugin], "-o", tmp_path / "out", monkeypatch=monkeypatch)
    assert got == code and err.startswith(message), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_config_file_and_override(capsys, monkeypatch, source, tmp_path):
    (tmp_path / "mtkc.toml").write_text(f'sdk = "{SDK}"\nseq_len = 8\npasses = ["bind-shapes", "fold", "rmsnorm"]\n')
    code, _, err = cli(capsys, "compile", source, "-o", "out1", cwd=tmp_path, monkeypatch=monkeypatch)
    assert code == 0, err
    manifest = json.loads((tmp_path / "out1" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["bind-shapes", "fold", "rmsnorm"]
    assert manifest["options"]["seq_len"] == 8
    code, _, err = cli(capsys, "compile", source, "-o", "out2", "--passes", "bind-shapes,fold", "--seq-len", "4")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out2" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["bind-shapes", "fold"]
    assert manifest["graphs"][0]["inputs"][0]["shape"] == [1, 4]
    (tmp_path / "mtkc.toml").write_text('sdk = "8.0"\nsequence = 8\n')
    code, _, err = cli(capsys, "compile", source, "-o", "out3")
    assert code == 2 and "mtkc.toml: unknown key 'sequence'" in err and not (tmp_path / "out3").exists()


def test_cli_explain_and_verbose_stats(capsys, caplog, source, tmp_path):
    caplog.set_level(logging.DEBUG, logger="mtkc.passes")  # what -v shows on stderr
    code, out, err = cli(capsys, "compile", source, "--sdk", SDK, "--seq-len", "8", "--passes", "bind-shapes,fold,rmsnorm",
                         "--explain", "rmsnorm", "-v", "-o", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    rms = next(p for p in report["passes"] if p["name"] == "rmsnorm")
    assert out.splitlines()[0] == f"rmsnorm: {rms['rewrites']} rewrites, {len(rms['misses'])} misses"
    assert len(out.splitlines()) == 1 + len(rms["misses"])
    stats = [r.getMessage() for r in caplog.records if " rewrites  nodes " in r.getMessage()]
    assert [line.split()[0] for line in stats] == ["bind-shapes", "fold", "rmsnorm"]
    code, _, err = cli(capsys, "compile", source, "--sdk", SDK, "--explain", "nope", "-o", tmp_path / "x")
    assert code == 2 and "unknown pass 'nope'" in err and not (tmp_path / "x").exists()


def test_cli_default_pipeline_verified_each_pass(capsys, source, tmp_path):
    """The product path: the SDK's default pipeline, every changing pass checked in onnxruntime."""
    code, _, err = cli(capsys, "compile", source, "--sdk", SDK, "--seq-len", "8", "--verify-each", "-o", tmp_path / "out")
    assert code == 0, err
    compiled = load(tmp_path / "out" / "model.onnx")
    outputs = execute.run(compiled.graph, execute.seeded_inputs(compiled.graph, 0), compiled.root)
    assert outputs["logits"].shape[:2] == (1, 8) and np.isfinite(outputs["logits"]).all()


def test_kv_cache_model_gives_prefill_and_decode_sharing_weights(exported, tmp_path):
    result = compile_model(exported("qwen2", "legacy17", cache=True), SDK, tmp_path / "out",
                           {"seq_len": 8, "cache_len": 16, "verify_each": True})
    graphs = {g["name"]: g for g in result.manifest["graphs"]}
    assert list(graphs) == ["prefill", "decode"]
    shapes = {name: {i["name"]: i["shape"] for i in g["inputs"]} for name, g in graphs.items()}
    assert shapes["prefill"]["past_key_0"] == shapes["decode"]["past_key_0"] == [1, 2, 16, 16]
    assert (shapes["prefill"]["position_ids"], shapes["decode"]["position_ids"]) == ([1, 8], [1, 1])
    assert {p["graph"] for p in result.manifest["passes"]} == {"prefill", "decode"}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.data")) == []  # one shared weights.bin
    for name in graphs:
        model = load(tmp_path / "out" / f"{name}.onnx")
        feeds = execute.seeded_inputs(model.graph, 0)
        feeds["position_ids"] = 16 + np.arange(feeds["position_ids"].size, dtype=np.int32).reshape(1, -1)
        outputs = execute.run(model.graph, feeds, model.root)
        assert np.isfinite(outputs["logits"]).all()


@pytest.mark.slow
def test_output_does_not_depend_on_hash_seed_or_folder_name(source, tmp_path):
    """Two fresh processes (PYTHONHASHSEED 0 / 12345, different OUT names): same bytes."""
    import os
    import subprocess
    import sys

    for seed, name in (("0", "first"), ("12345", "second")):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-m", "mtkc", "compile", str(source), "--sdk", SDK, "--seq-len", "8",
                        "-o", str(tmp_path / name)], check=True, env=env, capture_output=True, timeout=300)
    a, b = files(tmp_path / "first"), files(tmp_path / "second")
    reports = [json.loads(x.pop("report.json")) for x in (a, b)]
    for report in reports:  # per-pass wall-clock seconds: the only bytes allowed to differ
        for entry in report["passes"]:
            assert entry.pop("seconds") >= 0
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    assert reports[0] == reports[1]


def test_check_reports_coverage_after_passes_and_the_pass_per_node(source):
    from mtkc.pipeline.check import check

    report = check(source, SDK, seq_len=8).to_json()
    assert 0 < report["coverage"]["raw"] < report["coverage"]["compiled"] <= 1
    by_op = {g["op"]: g for g in report["unsupported"]}
    shape = by_op["Shape"]  # shape maths disappears once dims are bound and folded
    assert set(shape["rewritten_by"]) == set(shape["nodes"]) and set(shape["rewritten_by"].values()) <= {"bind-shapes", "fold"}
    pipeline = set(default_pipeline(SDK))
    assert all(p in pipeline for g in report["unsupported"] for p in g["rewritten_by"].values())


def test_a_failure_while_writing_keeps_the_previous_output(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    compile_model(source, SDK, out, {"passes": ["fold"]})
    before = files(out)

    def disk_full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mtkc.backend.deliver._write", disk_full)
    with pytest.raises(InputError, match="No space left"):  # the user's disk: exit 2
        compile_model(source, SDK, out, {"passes": ["bind-shapes", "fold"], "seq_len": 8, "overwrite": True})
    assert files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
