"""verify: stitched partitions and whole graphs against the original model, on tiny exports."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from mtkc.errors import InputError
from mtkc.pipeline import verify as V
from mtkc.pipeline.compile import compile_model

PASSES = ["bind-shapes", "fold", "cleanup", "mask", "rope", "rmsnorm", "swiglu", "attention"]


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "out"
    result = compile_model(exported("qwen2", "legacy17"), "8.0", out, {"seq_len": 8, "passes": PASSES, "no_convert": True})
    return out, result.manifest


def test_compiled_partitions_are_wired(compiled):
    _, manifest = compiled
    parts = manifest["graphs"][0]["partitions"]
    assert {p["target"] for p in parts} == {"npu", "cpu"}
    assert all(p["path"].startswith("model.") for p in parts)
    assert all(p["cpu_reasons"] and set(p["cpu_reasons"]) == set(p["nodes"]) for p in parts if p["target"] == "cpu")
    made = {"graph": {i["name"] for i in manifest["graphs"][0]["inputs"]}}
    for p in parts:  # every input comes from the graph or an earlier partition that outputs it
        for i in p["inputs"]:
            assert i["name"] in made[i["from"]], (p["id"], i)
        made[p["id"]] = {o["name"] for o in p["outputs"]}


def test_verify_passes_on_tiny_export(compiled):
    out, _ = compiled
    result = V.verify(out, samples=2)
    assert result.ok, V.format_text(result)
    assert {(c.pipeline, c.output) for c in result.checks} == {("partitions", "logits"), ("graph", "logits")}
    assert all(c.cosine > 0.99999 and c.max_abs < 1e-4 for c in result.checks)


def test_verify_llama_kv_cache_export(exported, tmp_path):
    out = tmp_path / "out"
    compile_model(exported("llama", "legacy17", cache=True), "8.0", out,
                  {"seq_len": 4, "cache_len": 8, "passes": PASSES, "no_convert": True})
    result = V.verify(out, samples=1)
    assert result.ok, V.format_text(result)
    assert {c.output for c in result.checks} == {"logits"} | {f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}


def test_verify_cli_fails_naming_the_output_on_corrupted_partition(compiled, run_cli, tmp_path):
    import shutil

    src, manifest = compiled
    out = tmp_path / "out"
    shutil.copytree(src, out)
    part = next(p for p in manifest["graphs"][0]["partitions"] if p["target"] == "npu" and
                any(o["dtype"] == "float32" for o in p["outputs"]))
    proto = onnx.load(out / part["path"])
    target = next(o for o in proto.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT)
    inner = target.name + "_corrupt_src"
    for node in proto.graph.node:  # rename the producer's output, then scale it by 1.5 into the old name
        node.output[:] = [inner if o == target.name else o for o in node.output]
        node.input[:] = [inner if i == target.name else i for i in node.input]
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.5, np.float32), "corrupt_scale"))
    proto.graph.node.append(onnx.helper.make_node("Mul", [inner, "corrupt_scale"], [target.name], name="corrupt"))
    onnx.save(proto, out / part["path"])
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    assert code == 1, stderr
    assert "mtkc: error:" in stderr and "'logits'" in stderr and "partitions" in stderr
    assert "MISMATCH" in stdout
    code, stdout, _ = run_cli("verify", out, "--samples", "1", "--format", "json")
    report = json.loads(stdout)
    assert code == 1 and not report["ok"]
    assert {(c["pipeline"], c["ok"]) for c in report["checks"]} == {("partitions", False), ("graph", True)}


def test_verify_missing_manifest_is_input_error(tmp_path, run_cli):
    code, _, stderr = run_cli("verify", tmp_path)
    assert code == 2 and "no manifest" in stderr


def test_causal_mask_and_feeds_mapping():
    from mtkc.contract.mask import attention_mask

    mask = attention_mask(2, 3, cached=[True, True, True])
    assert mask.shape == (1, 1, 2, 5)
    assert (mask[0, 0] == 0).tolist() == [[True, True, True, True, False], [True] * 5]
    args = [SimpleNamespace(name="input_ids", type="tensor(int64)", shape=["batch_size", "sequence_length"]),
            SimpleNamespace(name="attention_mask", type="tensor(int64)", shape=["batch_size", "total_sequence_length"]),
            SimpleNamespace(name="position_ids", type="tensor(int64)", shape=["batch_size", "sequence_length"]),
            SimpleNamespace(name="past_key_values.0.key", type="tensor(float)", shape=["batch_size", 2, "p", 16])]
    compiled = [{"name": "input_ids", "dtype": "int32", "shape": [1, 2]},
                {"name": "attention_mask", "dtype": "float32", "shape": [1, 1, 2, 5]},
                {"name": "position_ids", "dtype": "int32", "shape": [1, 2]},
                {"name": "past_key_0", "dtype": "float32", "shape": [1, 2, 3, 16]}]
    original, feeds = V.build_feeds(args, compiled, vocab=50, seed=0)
    assert original["attention_mask"].shape == (1, 5) and original["position_ids"].tolist() == [[3, 4]]
    assert feeds["input_ids"].dtype == np.int32 and (feeds["input_ids"] == original["input_ids"]).all()
    assert (feeds["past_key_0"] == original["past_key_values.0.key"]).all()
    assert V.match_output("present_key_0", ["logits", "present.0.key"]) == "present.0.key"
    with pytest.raises(InputError, match="compiled input 'pos_emb'"):
        V.build_feeds(args, compiled + [{"name": "pos_emb", "dtype": "float32", "shape": [1, 2, 2, 16]}], 50, 0)


def test_verify_prefill_and_decode_graphs(exported, tmp_path):
    """KV-cache compile (default pipeline): prefill T=4 and decode T=1; host tables feed hidden_states
    and pos_emb; presents are the new entries only."""
    out = tmp_path / "out"
    result = compile_model(exported("qwen2", "legacy17", cache=True), "8.0", out,
                           {"seq_len": 4, "cache_len": 8, "kv_cache": True, "rope_mode": "pos_emb", "no_convert": True})
    assert {"hidden_states", "pos_emb", "attention_mask", "past_key_0"} <= {i["name"] for i in result.manifest["graphs"][0]["inputs"]}
    result = V.verify(out, samples=1)
    assert result.ok, V.format_text(result)
    checked = {(c.graph, c.pipeline, c.output) for c in result.checks}
    assert {("prefill", "partitions", "logits"), ("decode", "partitions", "logits"),
            ("decode", "graph", "present_value_1")} <= checked


@pytest.mark.parametrize("cache_io", ["new", "sliding"])
def test_verify_runs_layer_chunks_as_a_chain(exported, tmp_path, run_cli, cache_io):
    """--chunks 2: the manifest wires chunk 1's hidden_states to chunk 0's hidden_states_out; verify
    feeds it through (not embedding rows) and compares every chunk's presents and the last one's logits."""
    out = tmp_path / "out"
    result = compile_model(exported("qwen2", "legacy17", cache=True), "8.0", out,
                           {"seq_len": 8, "cache_len": 16, "chunks": 2, "cache_io": cache_io, "no_convert": True})
    graphs = {g["name"]: g for g in result.manifest["graphs"]}
    assert list(graphs) == ["prefill_0", "prefill_1", "decode_0", "decode_1"]
    for variant in ("prefill", "decode"):
        assert [i.get("from") for i in graphs[f"{variant}_0"]["inputs"]] == [None] * len(graphs[f"{variant}_0"]["inputs"])
        wired = {i["name"]: i["from"] for i in graphs[f"{variant}_1"]["inputs"] if "from" in i}
        assert wired == {"hidden_states": {"graph": f"{variant}_0", "output": "hidden_states_out"}}
    assert [[g["name"] for g in c] for c in V.chains(result.manifest["graphs"])] == [
        ["prefill_0", "prefill_1"], ["decode_0", "decode_1"]]
    checked = V.verify(out, samples=2)
    assert checked.ok, V.format_text(checked)
    per_chunk = {(k, kind) for k in range(2) for kind in ("key", "value")}
    want = {(f"{v}_{k}", p, f"present_{kind}_{k}") for v in ("prefill", "decode") for p in ("partitions", "graph")
            for k, kind in per_chunk} | {(f"{v}_1", p, "logits") for v in ("prefill", "decode") for p in ("partitions", "graph")}
    assert {(c.graph, c.pipeline, c.output) for c in checked.checks} == want
    assert checked.skipped == []  # hidden_states_out feeds the next chunk: wiring, not an unmatched output
    assert max(c.max_abs for c in checked.checks) < 1e-4
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    # a row per graph and pipeline (4 x 2) + the oracle's one prompt (C=16 holds no prompt longer than T=8
    # and its new tokens); -v: a row per output (20)
    assert code == 0 and stdout.rstrip().endswith("min cosine 0.999)") and stdout.count(" ok") == 9, stderr
    assert " 2 outputs " in stdout and "present_key_0" not in stdout
    code, stdout, stderr = run_cli("verify", out, "--samples", "1", "-v")
    assert code == 0 and stdout.count(" ok") == 21 and "present_key_0" in stdout, stderr


def test_chains_reject_wiring_from_a_later_graph():
    graphs = [{"name": "a", "inputs": [{"name": "h", "from": {"graph": "b", "output": "h_out"}}]},
              {"name": "b", "inputs": []}]
    with pytest.raises(InputError, match="graph 'a' input is wired from 'b', not an earlier graph"):
        V.chains(graphs)


def test_rtol_is_relative_to_the_output_scale():
    """fp32 reordering noise near zero passes; an error of 1 % of the output's scale does not."""
    from mtkc.pipeline.verify import compare

    expected = np.array([50.0, -30.0, 1e-4, 0.0])
    noisy = expected + np.array([3e-3, -2e-3, 2e-3, -1e-3])  # ORT's own optimizer moves real logits so
    assert compare(noisy, expected, atol=1e-3, rtol=1e-3)[3]
    wrong = expected + np.array([0.0, 0.0, 0.5, 0.0])  # 1 % of max|expected| = 50
    max_abs, _, cosine, close = compare(wrong, expected, atol=1e-3, rtol=1e-3)
    assert not close and max_abs == 0.5 and cosine > 0.999  # cosine alone would not catch it
