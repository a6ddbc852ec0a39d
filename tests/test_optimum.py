"""Hugging Face Optimum's `optimum-cli export onnx` (text-generation with and without past), as users
run it: in a side venv with transformers 4.57 (`examples/optimum_export.py`), on the same seeded tiny
Qwen2 / Llama weights as every other fixture.

Each is compiled for SDK 6.0 and 8.0 (T=8, C=64; the no-past export with --kv-cache): `mtkc verify`
exits 0, greedy tokens through the compiled graphs equal transformers' `generate` for 16 tokens on
prompts shorter and longer than T, and on SDK 8.0 every node is on the NPU at opset <= 17.
"""

from __future__ import annotations

import json

import onnx
import pytest
from test_exporters import NEW, PROMPTS, C, T

import factory
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import Generator

CASES = [(family, cache) for family in ("qwen2", "llama") for cache in (True, False)]
SDKS = ("6.0", "8.0")


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """`compiled(family, cache, sdk)` -> OUT of compile (once per module)."""
    outs = {}

    def get(family: str, cache: bool, sdk: str):
        key = (family, cache, sdk)
        if key not in outs:
            out = tmp_path_factory.mktemp("optimum") / f"{family}-{'past' if cache else 'nopast'}-{sdk}"
            compile_model(exported(family, "optimum", cache=cache), sdk, out,
                          {"seq_len": T, "cache_len": C, "kv_cache": True})
            outs[key] = out
        return outs[key]

    return get


def test_the_exports_are_optimums(exported):
    """The fixtures are what optimum-cli writes (its I/O names, opset 18), not a silent stand-in."""
    for cache in (True, False):
        model = onnx.load(str(exported("qwen2", "optimum", cache=cache)), load_external_data=False)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 18
        inputs, outputs = factory.io_names(2, True)  # without past: the same minus the cache I/O
        assert [i.name for i in model.graph.input] == (inputs if cache else inputs[:3])
        assert [o.name for o in model.graph.output] == (outputs if cache else outputs[:1])
        config = json.loads((exported("qwen2", "optimum", cache=cache).parent / "config.json").read_text())
        assert config["transformers_version"] == "4.57.6"


@pytest.mark.parametrize("sdk", SDKS)
@pytest.mark.parametrize("family,cache", CASES)
def test_optimum_verifies_and_generates_transformers_tokens(family, cache, sdk, compiled, tiny_model, run_cli):
    out = compiled(family, cache, sdk)
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    assert code == 0, stdout + stderr
    generator = Generator(out)
    for prompt, ids in PROMPTS.items():
        tokens = generator.generate(ids, NEW)
        assert tokens == factory.reference_generate(tiny_model(family), ids, NEW), f"{family} {sdk} {prompt}"
        assert len(set(tokens)) > NEW // 2


@pytest.mark.parametrize("family,cache", CASES)
def test_optimum_sdk8_is_all_npu(family, cache, compiled):
    out = compiled(family, cache, "8.0")
    manifest = json.loads((out / "manifest.json").read_text())
    assert [g["name"] for g in manifest["graphs"]] == ["prefill", "decode"]
    for graph in manifest["graphs"]:
        assert [p["target"] for p in graph["partitions"]] == ["npu"], graph["name"]
        assert graph["inputs"][0]["name"] == "hidden_states"  # the embedding runs on the host
        model = onnx.load(str(out / graph["path"]), load_external_data=False)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) <= 17
        assert not {n.domain for n in model.graph.node} - {"", "ai.onnx"}
