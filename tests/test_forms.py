"""Issue 19 items 4-5: the forms users bring — the field report's own export call (the model itself,
`logits_to_keep` traced into an input), fp16 exports, QDQ with a cache, ORT-optimised graphs —
compiled, verified and generated; tokens against transformers' `generate`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtkc import cli

PROMPTS = ([5, 17, 99, 3, 250], [7, 1, 300, 42, 42, 9, 600, 11, 2, 77])
NEW = 6


def mtkc(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def field_report(tmp_path_factory, tiny_model):
    """`field_report(family="qwen2")` -> model.onnx of the field report's verbatim export call."""
    import field_export

    made = {}

    def get(family: str = "qwen2"):
        if family not in made:
            made[family] = field_export.export_field_report(tiny_model(family), tmp_path_factory.mktemp(f"fr-{family}"))
        return made[family]

    return get


def generated(capsys, out, prompt) -> list[int]:
    code, stdout, err = mtkc(capsys, "generate", out, "--prompt-ids", ",".join(map(str, prompt)),
                             "--max-new-tokens", NEW, "--format", "json")
    assert code == 0, err
    return json.loads(stdout)["tokens"]


def test_field_report_export_compiles_verifies_generates(capsys, field_report, tiny_model, tmp_path):
    """The report's call (no cache, opset 14, `logits_to_keep` an input): compile removes the index
    with a note, verify compares (its oracle feeds logits_to_keep=-1), generate equals transformers."""
    import factory
    import onnx

    path = field_report()
    assert [i.name for i in onnx.load(path, load_external_data=False).graph.input] == [
        "input_ids", "attention_mask", "logits_to_keep"]
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", path, "--sdk", "7.0", "--seq-len", 16, "-o", out)
    assert code == 0, err
    assert "input 'logits_to_keep'" in err and "removed: logits for every position" in err
    graph = json.loads((out / "manifest.json").read_text())["graphs"][0]
    assert "logits_to_keep" not in [i["name"] for i in graph["inputs"]]
    assert [o["shape"] for o in graph["outputs"] if o["name"] == "logits"] == [[1, 16, 1000]]
    code, stdout, err = mtkc(capsys, "verify", out, "--format", "json")
    assert code == 0, stdout + err
    result = json.loads(stdout)
    assert result["ok"] and result["generations"] and all(g["expected"] == g["actual"] for g in result["generations"])
    assert {c["output"] for c in result["checks"]} == {"logits"}
    model = tiny_model()
    for prompt in PROMPTS:
        assert generated(capsys, out, prompt) == factory.reference_generate(model, prompt, NEW)


def test_verify_names_the_original_that_does_not_run(capsys, exported, tmp_path, monkeypatch):
    """An original that onnxruntime refuses on verify's feeds is exit 2 naming the file (it was a
    NameError, exit 4)."""
    from mtkc.pipeline import verify

    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", exported("qwen2", "legacy17"), "--sdk", "8.0", "--seq-len", 8, "-o", out)
    assert code == 0, err

    def refuse(session, feeds):
        raise RuntimeError("indices element out of data bounds")

    monkeypatch.setattr(verify, "run_session", refuse)
    code, _, err = mtkc(capsys, "verify", out, "--new-tokens", 0)
    assert code == 2, err
    assert "model.onnx: the original model does not run in onnxruntime: indices element out of data bounds" in err
