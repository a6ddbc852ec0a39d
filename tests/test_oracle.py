"""verify's oracle: the original export run as its exporter meant it vs the compiled pipeline.

Each case here passed `mtkc verify` before the oracle existed (per-graph comparison with padded,
static feeds cannot see a change of meaning made by the mask, the cache or the padding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import factory
from mtkc.contract import mask as contract_mask
from mtkc.pipeline import verify as V
from mtkc.pipeline.compile import compile_model
from mtkc.pipeline.oracle import NEW_TOKENS, Original
from mtkc.runtime.generate import Generator

PLUGIN = Path(__file__).parent / "plugins" / "unmask_cache.py"
T, C = 8, 64
SCORE_SCALE = 8.0  # q and k projections (weights and biases) times 8: scores times 64
PROMPTS = ([5, 17, 300], list(range(40, 53)))  # shorter and longer than T


def _compile(model, out, **options):
    compile_model(model, "8.0", out, {"seq_len": T, "cache_len": C, "kv_cache": True, "no_convert": True, **options})
    return out


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """(model, export path): the tiny Qwen2 with q/k scaled so attention scores reach the hundreds."""
    import torch

    model = factory.build_model("qwen2", "tiny", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(SCORE_SCALE)
                proj.bias.mul_(SCORE_SCALE)
    return model, factory.export(model, tmp_path_factory.mktemp("loud"), "legacy17", cache=True)


def _max_score(model, prompt) -> float:
    """Largest |q.k/sqrt(d)| among the unmasked scores of a forward pass (eager attention's softmax input)."""
    import torch

    seen = []
    softmax = torch.nn.functional.softmax

    def spy(x, *args, **kwargs):
        seen.append(x[x > -1e30].abs().max().item())
        return softmax(x, *args, **kwargs)

    model.set_attn_implementation("eager")
    try:
        torch.nn.functional.softmax = spy
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        torch.nn.functional.softmax = softmax
        model.set_attn_implementation("sdpa")
    return max(seen)


def test_default_mask_value_keeps_tokens_when_scores_exceed_100(loud, tmp_path, run_cli):
    """With scores in the hundreds, -100 (the former default) lets masked keys in and changes the
    tokens; the default value does not, and verify tells the two apart."""
    model, path = loud
    assert _max_score(model, PROMPTS[1]) > 300
    default = _compile(path, tmp_path / "default")
    assert json.loads((default / "manifest.json").read_text())["options"]["mask_value"] == contract_mask.DEFAULT_VALUE
    generator = Generator(default)
    for prompt in PROMPTS:
        assert generator.generate(prompt, 16) == factory.reference_generate(model, prompt, 16)
    assert V.verify(default, samples=1).ok

    old = _compile(path, tmp_path / "minus100", mask_value=-100.0)
    assert Generator(old).generate(PROMPTS[1], 16) != factory.reference_generate(model, PROMPTS[1], 16)
    code, stdout, stderr = run_cli("verify", old, "--samples", "1")
    assert code == 1 and "differs from the original export" in stderr, stderr
    assert "tokens DIFFER" in stdout


def test_a_plugin_that_unmasks_the_cache_fails_verify(exported, tmp_path, run_cli):
    """Empty cache slots attended (issue 11's transformers-exporter case): the per-graph comparison,
    whose cache is full, is blind to it; the oracle, whose cache grows from empty, is not."""
    out = _compile(exported("qwen2", "legacy17", cache=True), tmp_path / "out", plugins=[str(PLUGIN)])
    assert V.verify(out, samples=1, new_tokens=0).ok
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    assert code == 1, stderr
    assert "generation from a 4-token prompt differs from the original export" in stderr
    assert stdout.rstrip().splitlines()[-1].startswith("MISMATCH")


def test_a_mask_value_smaller_than_the_scores_fails_verify(exported, tmp_path):
    out = _compile(exported("llama", "legacy17", cache=True), tmp_path / "out", mask_value=-1.0)
    result = V.verify(out, samples=1)
    assert not result.ok and any(not g.ok for g in result.generations)


@pytest.fixture(scope="module")
def qwen_cache(exported, tmp_path_factory):
    return _compile(exported("qwen2", "legacy17", cache=True), tmp_path_factory.mktemp("oracle") / "out")


def test_another_model_is_refused_with_exit_2(qwen_cache, exported, run_cli):
    code, stdout, stderr = run_cli("verify", qwen_cache, "--model", exported("llama", "legacy17", cache=True))
    assert code == 2 and stdout == ""
    assert "not the model compiled into" in stderr and "sha256" in stderr and len(stderr.strip().splitlines()) == 1


def test_nothing_compared_is_never_ok(qwen_cache, tmp_path, run_cli):
    out = tmp_path / "out"
    shutil.copytree(qwen_cache, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["graphs"] = []
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    assert code == 2 and "graphs" in stderr  # a manifest that lists no graph is not mtkc's: refused up front
    nothing = V.Result([], [], 1, 1e-3, 1e-3, 0.999)
    assert not nothing.ok and V.format_text(nothing).splitlines()[-1].startswith("NOTHING COMPARED")


@pytest.mark.parametrize("family, exporter, cache, options", [
    ("qwen2", "legacy17", True, {"cache_io": "sliding"}),
    ("llama", "hf", True, {"chunks": 2}),
    ("qwen2", "dynamo", False, {"rope_mode": "pos_emb"}),
])
def test_oracle_compares_generation_on_prompts_shorter_and_longer_than_t(exported, tmp_path, family, exporter,
                                                                         cache, options):
    out = _compile(exported(family, exporter, cache), tmp_path / "out", **options)
    result = V.verify(out, samples=1)
    assert result.ok, V.format_text(result)
    lengths = [g.prompt_len for g in result.generations]
    assert min(lengths) < T < max(lengths)
    for g in result.generations:
        assert len(g.expected) == NEW_TOKENS and g.expected == g.actual
        assert g.steps == g.prompt_len + NEW_TOKENS - 1 and g.cosine > 0.99999 and g.max_abs < 1e-4


def test_the_original_is_fed_its_own_inputs(exported):
    """Cache inputs start empty and grow by one per step; the mask is 2-D ones over past + new."""
    path = exported("llama", "hf", cache=True)
    session = V.load_session(path)
    original = Original.of(session, {})
    assert isinstance(original, Original), original
    assert (original.ids, original.mask, original.positions) == ("input_ids", "attention_mask", "position_ids")
    assert original.pasts[("key", 1)] == "input.cache.layers.1.keys"
    assert original.presents[("value", 0)] == "output.cache.layers.0.values"
    assert original.empty["input.cache.layers.0.keys"] == [1, 2, 0, 16]
    feeds = []
    run = session.run
    session.run = lambda names, f: feeds.append({k: v.shape for k, v in f.items()}) or run(names, f)
    rows = []
    tokens = original.generate([5, 17, 300], 3, rows.append)
    assert len(tokens) == 3 and [r.shape[0] for r in rows] == [3, 1, 1]
    assert [f["attention_mask"] for f in feeds] == [(1, 3), (1, 4), (1, 5)]
    assert [f["input.cache.layers.0.keys"][2] for f in feeds] == [0, 3, 4]


def test_oracle_runs_a_compile_without_kv_cache(exported, tmp_path):
    out = tmp_path / "out"
    compile_model(exported("qwen2", "legacy17"), "8.0", out, {"seq_len": T, "no_convert": True})
    result = V.verify(out, samples=1)
    assert result.ok, V.format_text(result)
    (g,) = result.generations  # no prompt longer than the static T fits
    assert g.prompt_len < T and g.expected == g.actual and len(g.actual) == T - g.prompt_len + 1
