"""Exports as users bring them: transformers' generation export (no mask input), dynamo with a
DynamicCache argument, onnxruntime-genai's builder in fp32 and int4 (GroupQueryAttention,
(Skip)SimplifiedLayerNormalization, MatMulNBits, GatherBlockQuantized).

Each is compiled for SDK 6.0 and 8.0 (T=8, C=64): greedy tokens through the compiled prefill/decode
graphs equal the reference for 16 tokens on prompts shorter and longer than T -- transformers'
`generate` for torch exports, onnxruntime-genai's own `Generator` on the original files for its
exports -- and on SDK 8.0 every node is on the NPU (the embedding runs on the host).
"""

from __future__ import annotations

import json

import onnx
import pytest

from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import Generator

T, C, NEW = 8, 64, 16
PROMPTS = {"short": [5, 17, 300], "long": list(range(40, 53))}
CASES = [("hf-generate", "qwen2"), ("hf-generate", "llama"), ("dynamo-cacheobj", "qwen2"),
         ("dynamo-cacheobj", "llama"), ("genai-fp32", "qwen2"), ("genai-fp32", "llama"), ("genai-int4-acc1", "qwen2")]
SDKS = ("6.0", "8.0")


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """`compiled(exporter, family, sdk)` -> OUT of compile (once per module)."""
    outs = {}

    def get(exporter: str, family: str, sdk: str):
        key = (exporter, family, sdk)
        if key not in outs:
            out = tmp_path_factory.mktemp("exporters") / "-".join(key)
            compile_model(exported(family, exporter, cache=True), sdk, out, {"seq_len": T, "cache_len": C})
            outs[key] = out
        return outs[key]

    return get


@pytest.fixture(scope="module")
def reference(reference_tokens):
    """`reference(exporter, family, prompt)` -> the greedy tokens the export is meant to give."""
    return lambda exporter, family, prompt: reference_tokens(family, exporter, True, PROMPTS[prompt], NEW)


@pytest.mark.parametrize("sdk", SDKS)
@pytest.mark.parametrize("exporter,family", CASES)
def test_generate_equals_the_exporters_reference(exporter, family, sdk, compiled, reference):
    generator = Generator(compiled(exporter, family, sdk))
    for prompt, ids in PROMPTS.items():
        tokens = generator.generate(ids, NEW)
        assert tokens == reference(exporter, family, prompt), f"{exporter} {family} SDK {sdk}, {prompt} prompt"
        assert len(set(tokens)) > NEW // 2


@pytest.mark.parametrize("exporter,family", CASES)
def test_sdk8_puts_every_node_on_the_npu(exporter, family, compiled):
    manifest = json.loads((compiled(exporter, family, "8.0") / "manifest.json").read_text())
    assert [g["name"] for g in manifest["graphs"]] == ["prefill", "decode"]
    for graph in manifest["graphs"]:
        assert [p["target"] for p in graph["partitions"]] == ["npu"], graph["name"]
        assert graph["inputs"][0]["name"] == "hidden_states"  # the embedding runs on the host
        model = onnx.load(str(compiled(exporter, family, "8.0") / graph["path"]), load_external_data=False)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) <= 17
        assert not {n.domain for n in model.graph.node} - {"", "ai.onnx"}


def test_generation_export_gets_the_additive_mask(exported, compiled):
    """transformers' generation export has no mask input: without one every zero cache slot was attended."""
    source = onnx.load(str(exported("qwen2", "hf-generate", cache=True)), load_external_data=False)
    assert not [i.name for i in source.graph.input if "mask" in i.name]
    manifest = json.loads((compiled("hf-generate", "qwen2", "8.0") / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        t = 1 if graph["name"] == "decode" else T
        io = {x["name"]: x for x in graph["inputs"]}
        assert io["attention_mask"]["dtype"] == "float32" and io["attention_mask"]["shape"] == [1, 1, t, C + t]


def test_int4_weights_keep_their_codes(compiled):
    """MatMulNBits -> int8 codes in [-8, 7] dequantised in-graph (no float weight folded by mtkc)."""
    out = compiled("genai-int4", "qwen2", "8.0")
    model = onnx.load(str(out / "decode.onnx"))
    int8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8) == 11  # 2 layers x (qkv, o, gate, up, down) + lm_head
    for t in int8:
        codes = onnx.numpy_helper.to_array(t)
        assert codes.min() >= -8 and codes.max() <= 7


def test_builder_cpu_default_int4_keeps_the_exact_weights(exported, compiled, reference):
    """The builder's CPU default (accuracy_level 4: onnxruntime rounds MatMulNBits' activations to
    int8) holds the same int4 codes and scales as accuracy_level 1; mtkc keeps them exactly, so its
    tokens are og.Generator's on the accuracy_level 1 files, and verify says why the level-4
    original itself can pick other near-tied tokens."""
    from mtkc.pipeline.verify import verify

    level4, level1 = (onnx.load(str(exported("qwen2", e, cache=True))) for e in ("genai-int4", "genai-int4-acc1"))
    assert [(t.name, t.raw_data) for t in level4.graph.initializer] == [(t.name, t.raw_data) for t in level1.graph.initializer]
    out = compiled("genai-int4", "qwen2", "8.0")
    generator = Generator(out)
    for prompt, ids in PROMPTS.items():
        assert generator.generate(ids, NEW) == reference("genai-int4-acc1", "qwen2", prompt), prompt
    notes = verify(out, samples=1, new_tokens=0).notes
    assert len(notes) == 1 and notes[0].startswith("the original's MatMulNBits have accuracy_level 4: onnxruntime may "
                                                   "round their activations to int8")


@pytest.mark.parametrize("exporter,family", CASES)
def test_verify_pairs_the_exports_own_io(exporter, family, compiled):
    """verify finds the export's cache I/O and logits by structure (`cache_0`, `cat_3`, `linear_14`)."""
    from mtkc.pipeline.verify import verify

    result = verify(compiled(exporter, family, "8.0"), samples=1)
    assert result.ok and not result.skipped
    assert {c.output for c in result.checks} == {"logits"} | {f"present_{k}_{i}" for i in range(2) for k in ("key", "value")}


@pytest.mark.parametrize("exporter", ["genai-fp32", "genai-int4-acc1"])
def test_genai_passes_keep_the_numbers(exporter, exported, tmp_path):
    """--verify-each: gqa, kv-cache, int4-weights ... each keep onnxruntime's numbers (int4: the
    accuracy_level 1 export, whose MatMulNBits compute in fp32 -- level 4 quantises activations)."""
    source = exported("qwen2", exporter, cache=True)
    result = compile_model(source, "8.0", tmp_path / "out", {"seq_len": T, "cache_len": C, "verify_each": True})
    def rewrites(name):
        return sum(r.rewrites for r in result.records if r.name == name)

    assert rewrites("gqa") == 4  # 2 layers, in prefill and decode
    assert rewrites("int4-weights") == (2 * 12 if exporter == "genai-int4-acc1" else 0)  # 11 MatMulNBits + embedding


def test_generation_prefill_stage_gets_a_cache_and_a_mask(exported, reference, tmp_path):
    """The prefill stage (no cache I/O, no mask input) with --kv-cache: the cache is inserted and
    the shape-built causal mask becomes the additive input; tokens equal transformers'."""
    out = tmp_path / "out"
    compile_model(exported("qwen2", "hf-generate", cache=False), "8.0", out,
                  {"seq_len": T, "cache_len": C, "kv_cache": True})
    generator = Generator(out)
    for prompt, ids in PROMPTS.items():
        assert generator.generate(ids, NEW) == reference("hf-generate", "qwen2", prompt), prompt
