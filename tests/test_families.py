"""The model families MediaTek users deploy, as tiny random-weight models (`factory`): Qwen3 (q/k
norm), Mistral (sliding window), Gemma 2 (GeGLU, soft-capping, embedding scale, alternating sliding
layers), Gemma 3 (5:1 local/global, two RoPE bases), Phi-3 (fused qkv/gate-up), Phi-3.5 / Phi-4-mini
(long-rope, partial rotary), Llama 3 (llama3 rope, tied).

Each case is compiled with a cache (T=8, C=64; no-cache exports with --kv-cache) for SDK 8.0 and
6.0: on 8.0 every node is on the NPU; `verify` passes; the greedy tokens through the compiled
prefill/decode graphs equal transformers' `generate` for 16 tokens on prompts shorter and longer
than T -- and longer than the sliding window (8), so a dropped window changes them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import factory
from mtkc.contract import io
from mtkc.contract import mask as contract_mask
from mtkc.errors import InputError
from mtkc.passes import mask_window
from mtkc.pipeline import verify as V
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import Generator

T, C, NEW = 8, 64, 16
PROMPTS = {"short": [5, 17, 300], "long": list(range(40, 53))}
SLOW = {("gemma3", "dynamo", False), ("mistral", "dynamo", False), ("qwen3", "dynamo", False)}
CASES = [pytest.param(*case, marks=[pytest.mark.slow] if case in SLOW else [], id="-".join(map(str, case[:2])) + ("-cache" if case[2] else ""))
         for case in [("qwen3", "legacy17", True), ("qwen3", "legacy17", False), ("mistral", "legacy17", False),
                      ("gemma2", "legacy17", False), ("gemma2", "dynamo", False), ("gemma3", "legacy17", False), ("phi3", "legacy17", True),
                      ("phi35", "dynamo", False), ("phi4mini", "dynamo", False), ("llama3", "legacy17", True),
                      ("qwen3", "dynamo", False), ("mistral", "dynamo", False), ("gemma3", "dynamo", False)]]
SDKS = ("8.0", "6.0")
WINDOWS = {"mistral": {factory.SLIDING_WINDOW}, "gemma2": {None, factory.SLIDING_WINDOW},
           "gemma3": {None, factory.SLIDING_WINDOW}}  # the mask inputs' windows (None: attention_mask)


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """`compiled(family, exporter, cache, sdk, **options)` -> OUT (once per module)."""
    outs = {}

    def get(family, exporter, cache, sdk, **options):
        key = (family, exporter, cache, sdk, tuple(sorted(options.items())))
        if key not in outs:
            out = tmp_path_factory.mktemp("families") / f"{family}-{exporter}-{int(cache)}-{sdk}"
            compile_model(exported(family, exporter, cache), sdk, out,
                          {"seq_len": T, "cache_len": C, "kv_cache": True, **options})
            outs[key] = out
        return outs[key]

    return get


@pytest.fixture(scope="module")
def reference(tiny_model):
    """`reference(family, prompt)` -> transformers' greedy tokens."""
    tokens = {}

    def get(family, prompt):
        if (family, prompt) not in tokens:
            tokens[family, prompt] = factory.reference_generate(tiny_model(family), PROMPTS[prompt], NEW)
        return tokens[family, prompt]

    return get


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("sdk", SDKS)
@pytest.mark.parametrize("family,exporter,cache", CASES)
def test_tokens_equal_transformers(family, exporter, cache, sdk, compiled, reference):
    generator = Generator(compiled(family, exporter, cache, sdk))
    for prompt, ids in PROMPTS.items():
        tokens = generator.generate(ids, NEW)
        assert tokens == reference(family, prompt), f"{family} {exporter} SDK {sdk}, {prompt} prompt"
        assert len(set(tokens)) > NEW // 2


@pytest.mark.parametrize("family,exporter,cache", CASES)
def test_placement_and_mask_inputs(family, exporter, cache, compiled):
    """SDK 8.0: one NPU partition per graph; 6.0: every CPU node has a reason. Sliding-window
    families take one mask input per window."""
    manifest = _manifest(compiled(family, exporter, cache, "8.0"))
    for graph in manifest["graphs"]:
        assert [p["target"] for p in graph["partitions"]] == ["npu"], graph["name"]
        masks = {io.mask_window(i["name"]) for i in graph["inputs"] if io.is_mask(i["name"])}
        assert masks == WINDOWS.get(family, {None}), graph["name"]
    report = json.loads((compiled(family, exporter, cache, "6.0") / "report.json").read_text())
    for name, graph in report["placement"].items():
        assert graph["cpu_nodes"] == len(graph["cpu"]) and all(c["reason"] for c in graph["cpu"]), name


@pytest.mark.parametrize("family,exporter,cache", [c for c in CASES if not c.marks][:10:2])
def test_verify_passes(family, exporter, cache, compiled):
    result = V.verify(compiled(family, exporter, cache, "8.0"), samples=1)
    assert result.ok, V.format_text(result)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_sliding_cache_io_keeps_the_window(family, compiled, reference):
    generator = Generator(compiled(family, "legacy17", False, "8.0", cache_io="sliding"))
    for prompt, ids in PROMPTS.items():
        assert generator.generate(ids, NEW) == reference(family, prompt), prompt


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_cropped_sliding_cache_export_is_refused_naming_it(family, exported, tmp_path):
    with pytest.raises(InputError, match=r"^layer 0 attention: cache input .past_key_values\.0\.key.: its present .present\.0\.key. keeps only the last entries.*--kv-cache, or with transformers. exporter"):
        compile_model(exported(family, "legacy17", True), "8.0", tmp_path / "out", {"seq_len": T, "cache_len": C})
    assert not (tmp_path / "out").exists()


def test_opset20_graph_kept_at_20_writes_valid_opset17_partitions(exported, tmp_path):
    """Gemma 2 dynamo (opset 20) without the gelu pass: Gelu has no opset-17 form, so the graph stays
    at 20 and Gelu runs on the CPU (with its reason); the NPU partitions, written at 17, take the
    RMSNorm ReduceMean in its opset-17 form, and the result still verifies."""
    import onnx

    out = tmp_path / "out"
    compile_model(exported("gemma2", "dynamo", False), "6.0", out,
                  {"seq_len": T, "cache_len": C, "kv_cache": True, "skip_passes": ["gelu"]})
    manifest = _manifest(out)
    for graph in manifest["graphs"]:
        for part in graph["partitions"]:
            onnx.checker.check_model(str(out / part["path"]))  # the "ReduceMean:13 has input size 2"
            model = onnx.load(str(out / part["path"]), load_external_data=False)
            if part["target"] == "npu":
                assert {n.op_type for n in model.graph.node} >= {"ReduceMean", "Tanh"}
                assert all(len(n.input) == 1 for n in model.graph.node if n.op_type == "ReduceMean")
    report = json.loads((out / "report.json").read_text())
    assert {c["op"] for c in report["placement"]["prefill"]["cpu"]} == {"Gelu"}
    assert V.verify(out, samples=1).ok


def test_window_mask_counts_positions_across_cache_gaps():
    """Slots 0 and 2 hold positions 0 and 1 (slot 1 empty: sliding layout padding); window 2."""
    m = contract_mask.attention_mask(2, 3, -1.0, cached=[1, 0, 1], window=2)[0, 0]
    assert m.tolist() == [[-1, -1, 0, 0, -1], [-1, -1, -1, 0, 0]]
    assert (contract_mask.attention_mask(2, 3, -1.0, cached=[1, 0, 1]) == 0).sum() == 7


def test_window_is_read_off_the_visibility():
    causal = np.tril(np.ones((5, 7), bool), 2)
    assert mask_window._window(causal) is None
    assert mask_window._window(causal & ~np.tril(np.ones((5, 7), bool), -1)) == 3
    assert "not a run" in mask_window._window(np.ones((5, 7), bool))
