"""`mtkc check`, `mtkc sdks`, `mtkc ops` on tiny real exports and through the CLI."""

from __future__ import annotations

import json

import pytest

from mtkc import cli
from mtkc.pipeline.check import check  # compiled=False: binding/verdict tests need no pipeline run

EXPORTERS = ["legacy14", "legacy17", "dynamo", "hf"]
FAMILIES = ["qwen2", "llama"]


def mtkc(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI in-process (one interpreter: imports and shape inference are paid once)."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def groups(report_json: dict) -> dict[tuple[str, str], dict]:
    return {(g["op"], g["reason"]): g for g in report_json["unsupported"]}


def reasons_of(report_json: dict, op: str) -> set[str]:
    return {g["reason"] for g in report_json["unsupported"] if g["op"] == op}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_check_reports_per_op_reasons(capsys, exported, family, exporter):
    model = exported(family, exporter, cache=False)
    code, text, _ = mtkc(capsys, "check", model, "--sdk", "6.0")
    assert code == 0
    assert "target      NeuroPilot 6.0 / mdla3.0" in text
    assert "op  " in text and "reason" in text and "example nodes" in text

    code, out, _ = mtkc(capsys, "check", model, "--sdk", "9.0", "--format", "json", "--seq-len", "8")
    assert code == 0
    report = json.loads(out)
    assert list(report) == ["schema_version", "sdk", "arch", "model", "verdict", "strict", "partitions",
                            "largest_partition", "graphs", "unbound", "bound", "picked", "suggested", "on_cpu", "nodes",
                            "coverage", "unsupported", "quantization", "decoder"]
    assert (report["sdk"], report["arch"]) == ("9.0", "mdla6.1")
    assert (report["decoder"]["layers"], report["decoder"]["kinds"], report["decoder"]["refused"],
            report["decoder"]["family"]) == (2, ["attention+SwiGLU"], [], "Qwen2/Llama-style")
    assert "decoder     Qwen2/Llama-style, 2 layers (2×attention+SwiGLU); cache none\n" \
        "            layers 0-1: 2 norms, q/k/v, rope, sdpa, SwiGLU\n" in text
    assert 0 < report["coverage"]["raw"] < report["coverage"]["compiled"] <= 1 and report["partitions"] >= 1
    assert sum(g["count"] for g in report["unsupported"]) < report["nodes"]
    found = groups(report)
    # on every SDK: RoPE tables, shape maths, int64 index maths, the embedding lookup, bool masks
    for op in ("Sin", "Cos", "Range"):
        assert (op, "op-unsupported") in found, op
    sin = found[("Sin", "op-unsupported")]  # the remedy names the pass that removed it in compile's pipeline
    assert {sin["remedy"]} == {f"pass {p} (compile runs it)" for p in sin["rewritten_by"].values()}
    assert ("Gather", "host-op") in found
    int64 = [g for g in report["unsupported"] if g["reason"] == "dtype-unsupported" and "int64" in g["detail"]]
    boolean = [g for g in report["unsupported"] if g["reason"] == "dtype-unsupported" and "bool" in g["detail"]]
    assert int64 and boolean
    for g in report["unsupported"]:  # the pass that removed every node of the group in compile, else the table's
        fixers = set(g["rewritten_by"].values())
        if len(fixers) == 1 and len(g["rewritten_by"]) == g["count"]:
            assert g["remedy"] == f"pass {fixers.pop()} (compile runs it)"
        else:
            assert "(compile runs it)" not in g["remedy"]
    assert not [g for g in report["unsupported"] if g["reason"] == "shape-dynamic"]  # seq bound, batch 1
    assert "MatMul" not in {g["op"] for g in report["unsupported"]}  # incl. QK^T, PV (BATCH_MATMUL)
    for g in report["unsupported"]:
        assert g["count"] == len(g["nodes"]) and g["detail"] and g["remedy"]


def test_dynamic_dims_flagged_until_bound(exported):
    model = exported("qwen2", "legacy17", cache=True)
    unbound = check(model, "6.0", compiled=False)
    assert unbound.unbound == ["batch_size", "past_sequence_length", "sequence_length", "total_sequence_length"]
    dynamic = {n for g in unbound.assessment.groups if g.reason == "shape-dynamic" for n in g.nodes}
    assert "/m/model/layers.0/input_layernorm/Pow" in dynamic
    half = check(model, "6.0", seq_len=8, compiled=False)  # cache length still open
    assert half.unbound == ["past_sequence_length", "total_sequence_length"]
    half_dynamic = {n for g in half.assessment.groups if g.reason == "shape-dynamic" for n in g.nodes}
    assert "/m/model/layers.0/input_layernorm/Pow" not in half_dynamic
    assert "/m/model/layers.0/self_attn/Softmax" in half_dynamic  # its length is cache + seq
    bound = check(model, "6.0", seq_len=8, cache_len=16, compiled=False)
    assert bound.unbound == [] and not [g for g in bound.assessment.groups if g.reason == "shape-dynamic"]
    assert bound.assessment.supported > half.assessment.supported > unbound.assessment.supported


def test_input_shape_binds_named_inputs(capsys, exported):
    model = exported("llama", "legacy17", cache=False)
    a = check(model, "8.0", input_shapes={"input_ids": (1, 5), "attention_mask": (1, 5)}, compiled=False)
    b = check(model, "8.0", seq_len=5, compiled=False)
    assert a.to_json()["unsupported"] == b.to_json()["unsupported"] and a.unbound == []
    code, _, err = mtkc(capsys, "check", model, "--sdk", "8.0", "--input-shape", "ids=1,5")
    assert code == 2 and "the model has no input 'ids'" in err
    code, _, err = mtkc(capsys, "check", model, "--sdk", "8.0", "--input-shape", "input_ids=1,5,3")
    assert code == 2 and "--input-shape input_ids: 3 dims given, the input has rank 2" in err


def test_unknown_sdk_lists_available(capsys, exported):
    code, out, err = mtkc(capsys, "check", exported("qwen2", "legacy17"), "--sdk", "5.0")
    assert (code, out) == (2, "")
    assert err.strip() == "mtkc: error: unknown SDK '5.0'; available: 6.0, 7.0, 8.0, 9.0"


def test_strict_output_file_and_determinism(capsys, exported, tmp_path, monkeypatch):
    model = exported("qwen2", "legacy14")
    monkeypatch.chdir(tmp_path)
    code, first, _ = mtkc(capsys, "check", model, "--sdk", "8.0", "--format", "json")
    assert code == 0 and list(tmp_path.iterdir()) == []  # writes nothing without -o
    assert mtkc(capsys, "check", model, "--sdk", "8.0", "--format", "json")[1] == first
    assert mtkc(capsys, "check", model, "--sdk", "8.0", "--strict")[0] == 0  # compile leaves nothing on the CPU
    assert json.loads(first)["strict"] == "pass" and json.loads(first)["bound"] == {"seq_len": 128, "batch": 1}
    assert mtkc(capsys, "check", model, "--sdk", "8.0", "--strict", "--passes", "bind-shapes")[0] == 1
    code, out, err = mtkc(capsys, "check", model, "--sdk", "8.0", "--format", "json", "-o", "r.json")
    assert (code, out) == (0, "") and "wrote r.json" in err
    assert (tmp_path / "r.json").read_text() == first


def test_sdks_command(capsys):
    code, out, _ = mtkc(capsys, "sdks", "--format", "json")
    rows = {r["sdk"]: r for r in json.loads(out)}
    assert code == 0 and list(rows) == ["6.0", "7.0", "8.0", "9.0"]
    assert rows["6.0"]["archs"] == ["mdla2.0", "mdla3.0"] and rows["6.0"]["default_arch"] == "mdla3.0"
    assert rows["9.0"]["extends"] == "8.0" and rows["6.0"]["extends"] is None
    code, text, _ = mtkc(capsys, "sdks")
    assert code == 0 and text.splitlines()[0].split()[:4] == ["sdk", "archs", "default", "extends"]


def test_ops_command(capsys):
    code, out, _ = mtkc(capsys, "ops", "--sdk", "8.0", "--op", "ai.onnx:SimplifiedLayerNormalization", "--format", "json")
    (entry,) = json.loads(out)["entries"]
    assert code == 0 and entry["supported"] and entry["constraints"]["last_axis"] == "axis"
    assert entry["provenance"] == "mtk-llm-graphs" and entry["sources"] == ["L"]
    code, text, _ = mtkc(capsys, "ops", "--sdk", "6.0", "--op", "ai.onnx:Sin")
    assert code == 0 and "ai.onnx:Sin  [not on NPU]  documented (A, E, T)" in text and "rope" in text
    code, text, _ = mtkc(capsys, "ops", "--sdk", "6.0", "--arch", "mdla2.0", "--op", "Conv")
    assert "attributes" in text and "'group': [1]" in text
    code, _, err = mtkc(capsys, "ops", "--sdk", "6.0", "--op", "Frobnicate")
    assert code == 2 and "op 'Frobnicate' is not in the NeuroPilot 6.0 table" in err


@pytest.mark.parametrize("exporter", ["dynamo", "hf"])
def test_cache_dims_of_dynamo_and_hf_exports_bind(exported, exporter):
    """dynamo names the mask length s53, HF gives every past tensor its own symbol: all bind."""
    model = exported("qwen2", exporter, cache=True)
    open_cache = check(model, "8.0", seq_len=8, compiled=False)
    assert open_cache.unbound and any(g.reason == "shape-dynamic" for g in open_cache.assessment.groups)
    bound = check(model, "8.0", seq_len=8, cache_len=16, compiled=False)
    assert bound.unbound == [] and not [g for g in bound.assessment.groups if g.reason == "shape-dynamic"]


def test_ort_fused_export_and_no_stray_files(capsys, exported, tmp_path, monkeypatch):
    """com.microsoft ops get op-level reasons; symbolic shape inference stops at FusedMatMul
    without writing its debug model into the working directory, and types what precedes it."""
    model = exported("qwen2", "hf-ortfused")
    monkeypatch.chdir(tmp_path)
    for sdk in ("6.0", "8.0"):
        code, out, _ = mtkc(capsys, "check", model, "--sdk", sdk, "--seq-len", "8", "--format", "json")
        found = groups(json.loads(out))
        assert found[("RotaryEmbedding", "op-unsupported")]["remedy"].startswith("pass rope")
        assert found[("SkipSimplifiedLayerNormalization", "op-unsupported")]["remedy"].startswith("pass rmsnorm")
        assert found[("FusedMatMul", "op-unsupported")]["domain"] == "com.microsoft"
        assert found[("FusedMatMul", "op-unsupported")]["remedy"].startswith("pass contrib-ops")
        assert not [g for g in found.values() if g["reason"] == "shape-dynamic"]
    assert list(tmp_path.iterdir()) == []


def test_check_runs_the_users_pipeline(run_cli, exported, tmp_path):
    """--passes/--skip-pass/--plugin/--config shape `coverage.compiled` and `rewritten_by` as in
    compile; a plugin that cannot be loaded is an exit-2 error naming it."""
    from pathlib import Path

    plugins = Path(__file__).parent / "plugins"
    model = exported("qwen2", "legacy17")
    base = ("check", model, "--sdk", "8.0", "--seq-len", "8", "--format", "json")

    def report(*args, cwd=None):
        code, out, err = run_cli(*base, *args, cwd=cwd)
        assert code == 0, err
        return json.loads(out)

    def fixers(r, op):
        return {p for g in r["unsupported"] if g["op"] == op for p in g["rewritten_by"].values()}

    assert fixers(report(), "IsNaN") == {"attention"}
    assert fixers(report("--skip-pass", "attention"), "IsNaN") == {"mask"}
    (tmp_path / "mtkc.toml").write_text('skip_passes = ["attention"]\n')
    assert fixers(report("--config", tmp_path / "mtkc.toml"), "IsNaN") == {"mask"}
    assert fixers(report(cwd=tmp_path), "IsNaN") == {"mask"}  # ./mtkc.toml, as compile reads it

    folded = report("--passes", "bind-shapes,fold")
    assert 0 < folded["coverage"]["compiled"] < 1
    assert {p for g in folded["unsupported"] for p in g["rewritten_by"].values()} == {"fold"}
    negated = report("--passes", "bind-shapes,fold,negate-output", "--plugin", plugins / "negate_output.py")
    assert negated["coverage"]["compiled"] > folded["coverage"]["compiled"]  # the plugin's Neg node (NPU op)

    code, out, err = run_cli(*base, "--plugin", plugins / "import_error.py")
    assert (code, out) == (2, "")
    assert err.startswith("mtkc: error: plugin ") and "import_error.py failed to import" in err
    assert "Traceback" not in err
    code, _, err = run_cli(*base, "--passes", "no-such-pass")
    assert code == 2 and "unknown pass 'no-such-pass'" in err


def test_check_table_fits_the_terminal_and_remedies_have_one_style(exported):
    """Wrapped to the width given (a terminal's), nothing lost; every remedy is a pass, an option or an SDK."""
    import re

    from mtkc.commands.check import render

    report = check(exported("qwen2", "hf"), "6.0")
    wide, narrow = render(report), render(report, 120)
    table = narrow.split("\n\n", 1)[1].splitlines()
    assert max(len(line) for line in wide.splitlines()) > 120 and all(len(line) <= 120 for line in table)
    assert sorted(" ".join(table).split()) == sorted(wide.split("\n\n", 1)[1].split())  # every word, wrapped
    style = re.compile(r"^(pass [\w-]+( \(planned\))?(, pass [\w-]+( \(planned\))?)*( \(compile runs it\))?|--[a-z-]+.*|"
                       r"--sdk \d+\.\d+|CPU fallback)$")
    remedies = {report.remedy(g) for g in report.assessment.groups}
    assert remedies and all(style.match(r) for r in remedies), remedies


def test_rewritten_by_names_a_pass_that_edits_a_node_in_place(tmp_path):
    """check's tracker sees a fix that keeps the node object and only edits its attribute (a guard
    for any tracker that skips nodes it thinks unchanged): the Softmax over axis 1 (not the last,
    as SDK 6.0 needs) stays after `cleanup` and is fixed by the plugin that sets its axis."""
    from pathlib import Path

    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="soft", axis=1)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])])
    path = tmp_path / "softmax.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    plugin = str(Path(__file__).parent / "plugins" / "softmax_last.py")

    raw = check(path, "6.0", compiled=False)
    assert [n for g in raw.assessment.groups for n in g.nodes] == ["soft"]
    report = check(path, "6.0", passes=["cleanup", "softmax-last"], plugins=[plugin])
    assert report.rewritten_by == {"soft": "softmax-last"}
    assert report.graphs[0].cpu_nodes == 0
    untouched = check(path, "6.0", passes=["cleanup"])
    assert untouched.rewritten_by == {} and untouched.graphs[0].cpu_nodes == 1
