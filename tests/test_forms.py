"""Issue 19 items 4-5: the forms users bring — the field report's own export call (the model itself,
`logits_to_keep` traced into an input), fp16 exports, QDQ with a cache, ORT-optimised graphs —
compiled, verified and generated; tokens against transformers' `generate`."""

from __future__ import annotations

import copy
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


@pytest.fixture(scope="session")
def half_export(tmp_path_factory, tiny_model):
    """`half_export(kind, family)` -> model.onnx: "torchscript" (`model.half()`, cache) or "genai" (fp16 cuda)."""
    import field_export

    made = {}

    def get(kind: str, family: str = "qwen2"):
        if (kind, family) not in made:
            model = copy.deepcopy(tiny_model(family))
            folder = tmp_path_factory.mktemp(f"half-{kind}-{family}")
            made[kind, family] = (field_export.export_half(model, folder) if kind == "torchscript"
                                  else field_export.export_genai_fp16(model, folder))
        return made[kind, family]

    return get


@pytest.mark.parametrize("kind,family", [("torchscript", "llama"), ("torchscript", "qwen2"), ("genai", "qwen2")])
def test_fp16_exports_keep_their_dtype(capsys, half_export, tiny_model, tmp_path, kind, family):
    """fp16 exports compile with fp16 cache I/O (the mask and positions stay the contract's), run,
    verify (fp16 tolerances, noted) and generate the original export's tokens."""
    import copy

    import factory

    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", half_export(kind, family), "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64,
                        "-o", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    dtypes = {i["name"]: i["dtype"] for g in manifest["graphs"] for i in g["inputs"] + g["outputs"]}
    assert dtypes["past_key_0"] == dtypes["present_value_1"] == dtypes["logits"] == "float16"
    assert dtypes["attention_mask"] == "float32"
    code, stdout, err = mtkc(capsys, "verify", out, "--format", "json")
    assert code == 0, stdout + err
    result = json.loads(stdout)
    assert result["atol"] == 1e-2 and any("fp16" in n for n in result["notes"])
    assert len(result["generations"]) == 2 and all(g["ok"] for g in result["generations"])
    if kind == "torchscript":  # transformers' own fp16 generate (genai's fp16 graph is CUDA's: verify ran it)
        model = copy.deepcopy(tiny_model(family)).half()
        prompt = PROMPTS[0]
        assert generated(capsys, out, prompt) == factory.reference_generate(model, prompt, NEW)


def test_a_pass_that_mixes_dtypes_is_a_bug_named():
    """A built-in pass leaving Add(fp16, fp32) is exit 4 naming it; a plugin's is exit 2; the input's 2."""
    import onnx_graphsurgeon as gs

    from mtkc.errors import InputError, InternalError, PassError
    from mtkc.manager.invariants import check_dtypes

    a, b = gs.Variable("a", np.float16, [2]), gs.Variable("b", np.float32, [2])
    graph = gs.Graph(nodes=[gs.Node("Add", "mix", inputs=[a, b], outputs=[gs.Variable("c", np.float16, [2])])],
                     inputs=[a, b])

    class Built:
        name, origin = "rope", "built-in"

    class Plugin:
        name, origin = "mine", "plugin mine.py"

    with pytest.raises(InternalError, match=r"pass 'rope' left node 'mix' \(Add\) mixes float16 and float32") as bug:
        check_dtypes(graph, Built())
    assert bug.value.exit_code == 4
    with pytest.raises(PassError, match="pass 'mine'"):
        check_dtypes(graph, Plugin())
    with pytest.raises(InputError, match="input model"):
        check_dtypes(graph, None, InputError)


class _CacheReader:
    """Calibration feeds for a tiny cache export (qwen2: 2 layers, 2 kv heads, head dim 16)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        pasts = lambda: {f"past_key_values.{i}.{k}": rng.standard_normal((1, 2, 5, 16)).astype(np.float32)  # noqa: E731
                         for i in range(2) for k in ("key", "value")}
        self.data = [{"input_ids": rng.integers(0, 1000, (1, 4)), "attention_mask": np.ones((1, 9), np.int64),
                      "position_ids": np.arange(5, 9)[None], **pasts()} for _ in range(3)]

    def get_next(self):
        return self.data.pop() if self.data else None


@pytest.fixture(scope="module")
def qdq_cache(exported, tmp_path_factory):
    """`quantize_static` (QDQ, every op type) of the tiny qwen2 cache export."""
    import logging
    import warnings

    from onnxruntime.quantization import QuantFormat, quantize_static

    path = tmp_path_factory.mktemp("qdq-cache") / "model.onnx"
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zero points of constant ranges
            quantize_static(str(exported("qwen2", "legacy17", cache=True)), str(path), _CacheReader(),
                            quant_format=QuantFormat.QDQ)
    finally:
        logging.getLogger().setLevel(level)
    return path


def test_qdq_with_a_cache_is_split_like_its_float_twin(capsys, qdq_cache, tmp_path):
    """Q/DQ on the cache I/O hides no cache: prefill/decode with past_key_<i>, float cache I/O, verify's
    oracle (the QDQ export run as exported) equal, generate runs; `--no-kv-cache` leaves the export's
    cache inputs and generate says so (exit 2, it was 4)."""
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", qdq_cache, "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64, "-o", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert [g["name"] for g in manifest["graphs"]] == ["prefill", "decode"]
    decode = {i["name"]: i for i in manifest["graphs"][1]["inputs"] + manifest["graphs"][1]["outputs"]}
    assert decode["past_key_1"]["shape"] == [1, 2, 64, 16] and decode["present_value_1"]["dtype"] == "float32"
    code, stdout, err = mtkc(capsys, "verify", out, "--format", "json")
    assert code == 0, stdout + err
    assert len(json.loads(stdout)["generations"]) == 2
    assert len(generated(capsys, out, PROMPTS[1])) == NEW
    flat = tmp_path / "flat"
    code, _, err = mtkc(capsys, "compile", qdq_cache, "--sdk", "8.0", "--seq-len", 8, "--no-kv-cache", "-o", flat)
    assert code == 0, err
    code, _, err = mtkc(capsys, "generate", flat, "--prompt-ids", "1,2,3", "--max-new-tokens", 2)
    assert code == 2 and "input 'past_key_values.0.key' is none the runtime feeds" in err, err


@pytest.fixture(scope="module")
def qdq_cache_float_mask(exported, tmp_path_factory):
    """`quantize_static` (QDQ) of the tiny qwen2 cache export with the mask's Where and Add left float
    (`nodes_to_exclude`): the calibrated range of a finfo.min mask overflows the scale to inf."""
    import logging
    import warnings

    import onnx
    from onnxruntime.quantization import QuantFormat, quantize_static

    source = exported("qwen2", "legacy17", cache=True)
    model = onnx.load(source, load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    sites = [producer[n.input[0]] for n in model.graph.node if n.op_type == "Softmax"]
    exclude = [s.name for s in sites] + [producer[i].name for s in sites for i in s.input
                                         if i in producer and producer[i].op_type == "Where"]
    path = tmp_path_factory.mktemp("qdq-cache-float-mask") / "model.onnx"
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_static(str(source), str(path), _CacheReader(), quant_format=QuantFormat.QDQ, nodes_to_exclude=exclude)
    finally:
        logging.getLogger().setLevel(level)
    return path


def test_qdq_with_a_cache_runs_every_node_on_the_npu(capsys, qdq_cache_float_mask, qdq_cache, tmp_path):
    """The mask site seen through the scores' Q/DQ (the mask becomes the additive input) and repeat_kv's
    rank-5 Q/DQ merged by rank4: SDK 8.0 puts every node on the NPU and verify equals the QDQ export.
    With the mask itself quantised (scale inf: NaN where visible), the mask stays, and the pass says why."""
    from mtkc.pipeline.compile import compile_model

    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", qdq_cache_float_mask, "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64,
                        "-o", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert {g["name"]: [p["target"] for p in g["partitions"]] for g in manifest["graphs"]} == \
        {"prefill": ["npu"], "decode": ["npu"]}
    code, stdout, err = mtkc(capsys, "verify", out, "--samples", 1)
    assert code == 0, stdout + err
    result = compile_model(qdq_cache, "8.0", tmp_path / "inf", {"seq_len": 8, "cache_len": 64})
    misses = [m.reason for r in result.records if r.name == "mask" for m in r.misses]
    assert misses and all("has scale inf: the quantised mask is NaN/-inf" in m for m in misses), misses


def test_ort_optimised_graph_without_a_domain_import_is_accepted(capsys, exported, tiny_model, tmp_path):
    """An ORT-optimised export (com.microsoft fused norms) whose opset imports lack com.microsoft
    (Olive writes these; onnxruntime runs them) checks, compiles, verifies and generates transformers' tokens."""
    import factory
    import onnx
    import onnxruntime as ort

    model = onnx.load(exported("qwen2", "ortopt", cache=True))
    assert any(n.domain == "com.microsoft" for n in model.graph.node)
    kept = [o for o in model.opset_import if o.domain != "com.microsoft"]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    path = tmp_path / "olive.onnx"
    onnx.save(model, path)
    ort.InferenceSession(str(path))  # onnxruntime accepts it
    code, _, err = mtkc(capsys, "check", path, "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64)
    assert code == 0, err
    assert "uses domain 'com.microsoft' without an opset import; imported at version 1" in err
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", path, "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64, "-o", out)
    assert code == 0, err
    code, stdout, err = mtkc(capsys, "verify", out)
    assert code == 0, stdout + err
    assert generated(capsys, out, PROMPTS[1]) == factory.reference_generate(tiny_model(), PROMPTS[1], NEW)


def test_the_field_report_walkthrough_runs_as_written(tmp_path):
    """examples/field_report.py (the README's walkthrough): every step's exit code as shown there,
    generate equal to transformers, the stand-in converter handed every NPU partition its samples."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "field_report.py"
    proc = subprocess.run([sys.executable, str(example), "--out", str(tmp_path), "--prompts", "4"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    steps = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("$ mtkc")]
    assert steps == ["check", "compile", "verify", "generate", "calibrate", "verify", "convert"]
    assert "-> identical" in proc.stdout and "removed: logits for every position" in proc.stdout
    assert proc.stdout.count("[exit 0,") == 6  # verify --quant may be under its bar (exit 1), and says why
    records = sorted((tmp_path / "out" / "dla").glob("*.npu*.dla"))
    assert [r.name for r in records] == ["decode.npu0.dla", "prefill.npu0.dla"]
    assert all(json.loads(r.read_text())["quantization"]["samples"] > 0 for r in records)


def _phi2(hidden: int = 128):
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=2 * hidden, vocab_size=1000, max_position_embeddings=256,
                       partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2)
    return PhiForCausalLM(config).eval()


def test_phi2_genai_partial_rotary_compiles_and_verifies(capsys, tmp_path):
    """onnxruntime-genai's Phi-2 (partial rotary: cos cache narrower than D/2) decomposes with the
    head size from the packed QKV width (was: D from the cos cache, then a dead-end --input-shape
    remedy); verify's oracle (the genai export in onnxruntime) agrees on logits and tokens."""
    import subprocess
    import sys

    import factory

    hf, folder = tmp_path / "hf", tmp_path / "genai"
    factory.save_model(_phi2(), hf)
    factory._word_tokenizer(1000).save_pretrained(hf)
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf, "-o", folder,
                           "-p", "fp32", "-e", "cpu"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", folder / "model.onnx", "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64,
                        "-o", out)
    assert code == 0, err
    decode = json.loads((out / "manifest.json").read_text())["graphs"][1]
    assert {i["name"]: i["shape"] for i in decode["inputs"]}["past_key_0"] == [1, 4, 64, 32]
    code, stdout, err = mtkc(capsys, "verify", out, "--format", "json")
    assert code == 0, stdout + err
    assert len(json.loads(stdout)["generations"]) == 2


def test_kv_cache_on_a_packed_key_names_the_attention(capsys, tmp_path):
    """GPT-2 (`--kv-cache` on a no-cache export): its key reaches attention packed [B,S,H·D] through
    one Transpose: exit 2 naming the layer, the attention MatMul and the Split (was `fused op None`)."""
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import factory

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
                                       bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.randint(3, 1000, (2, 7))
    path = tmp_path / "gpt2.onnx"
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in ("input_ids", "attention_mask", "logits")}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(factory.wrap(model, False), (ids, torch.ones_like(ids)), str(path), dynamo=False,
                          opset_version=17, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes=axes)
    code, _, err = mtkc(capsys, "compile", path, "--sdk", "8.0", "--seq-len", 8, "--cache-len", 64, "--kv-cache",
                        "-o", tmp_path / "out")
    assert code == 2, err
    assert "layer 0: the key entering attention at MatMul '/m/transformer/h.0/attn/MatMul'" in err
    assert "(made by Split '/m/transformer/h.0/attn/Split')" in err and "fused op None" not in err
    assert not (tmp_path / "out").exists()
