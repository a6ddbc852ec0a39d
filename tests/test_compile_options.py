"""LLM-block options on the compile command line: --mask-value, --rope-mode, --embedding."""

import json


def test_mask_value_and_rope_mode_reach_the_graphs(exported, run_cli, tmp_path):
    model = exported("qwen2", "legacy17", cache=True)
    out = tmp_path / "out"
    code, _, err = run_cli("compile", str(model), "--sdk", "8.0", "--seq-len", "8", "--cache-len", "16", "-o", str(out),
                           "--no-convert", "--mask-value", "-10000", "--rope-mode", "pos_emb", "--embedding", "cpu")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["mask_value"] == -10000.0
    inputs = [i["name"] for i in manifest["graphs"][0]["inputs"]]
    assert "pos_emb" in inputs and "position_ids" not in inputs  # rope_mode=pos_emb
    assert inputs[0] == "input_ids"  # embedding=cpu keeps the token ids as the graph input
    code, out_text, err = run_cli("verify", str(out), "--samples", "1")
    assert code == 0, out_text + err


def test_mask_value_must_be_finite_and_negative(exported, run_cli, tmp_path):
    model = exported("qwen2", "legacy17", cache=True)
    code, _, err = run_cli("compile", str(model), "--sdk", "8.0", "-o", str(tmp_path / "o"), "--mask-value=5")
    assert code == 2
    assert err.strip() == "mtkc: error: --mask-value: expected a finite negative number (e.g. -100), got 5.0"
    assert not (tmp_path / "o").exists()
