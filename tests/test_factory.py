"""The model factory: exports of both families run in onnxruntime and match torch off the trace shape."""

from __future__ import annotations

import collections
import copy
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

import factory
from mtkc.ir import execute

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAMILIES = ["qwen2", "llama"]
EXPORTERS = ["legacy14", "legacy17", "dynamo", "hf", "hf-ortfused", "dynamo-ortfused", "ortopt"]
SLOW = {("llama", "hf-ortfused"), ("llama", "dynamo-ortfused")}  # 20-50 s exports on a busy machine
VARIANTS = [pytest.param(f, e, marks=[pytest.mark.slow] if (f, e) in SLOW else []) for e in EXPORTERS for f in FAMILIES]
MS_OPS = {  # com.microsoft ops each fused variant must contain (tiny: 2 layers)
    "hf-ortfused": {"SkipSimplifiedLayerNormalization": 4, "RotaryEmbedding": 4},
    "dynamo-ortfused": {"SkipSimplifiedLayerNormalization": 4, "MultiHeadAttention": 2},
    "ortopt": {"SkipSimplifiedLayerNormalization": 4},
}


def _graph(path):
    return gs.import_onnx(onnx.load(str(path), load_external_data=False))


def _run(path, feeds):
    model = onnx.load(str(path), load_external_data=False)
    names = [i.name for i in model.graph.input]
    return execute.run(model, dict(zip(names, feeds)), root=path.parent)


@pytest.mark.parametrize("family, exporter", VARIANTS)
@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "cache"])
def test_export_matches_torch(exported, tiny_model, family, exporter, cache):
    """Batch 3, seq 4, past 6 (trace: 2/7/5), row 0 left-padded; padded query rows are excluded
    (fully masked rows are undefined: legacy zeroes them, dynamo does not)."""
    model = tiny_model(family)
    path = exported(family, exporter, cache)
    feeds = [t.numpy() for t in factory.trace_inputs(model.config, cache, batch=3, seq=4, past=6, seed=3)]
    got = _run(path, feeds)
    if cache:
        ref = factory.reference_logits(model, feeds[0], feeds[1], past=feeds[3:], position_ids=feeds[2])
    else:
        ref = [factory.reference_logits(model, feeds[0], feeds[1])]
    assert list(got)[0] == "logits" and got["logits"].shape == (3, 4, model.config.vocab_size)
    assert len(got) == len(ref) == (1 + 2 * model.config.num_hidden_layers if cache else 1)
    valid = feeds[1][:, -4:].astype(bool)
    np.testing.assert_allclose(got["logits"][valid], ref[0][valid], atol=1e-4, rtol=1e-4)
    for name, want in list(zip(got, ref))[1:]:
        np.testing.assert_allclose(got[name], want, atol=1e-4, rtol=1e-4, err_msg=name)
    ops = collections.Counter(n.op for n in _graph(path).nodes if n.domain == "com.microsoft")
    assert dict(ops) | MS_OPS.get(exporter, {}) == dict(ops), ops
    assert bool(ops) == (exporter in MS_OPS)


@pytest.mark.parametrize("exporter", ["legacy14", "legacy17", "dynamo", "ortopt"])
def test_cache_io_names(exported, exporter):
    graph = onnx.load(str(exported("qwen2", exporter, cache=True)), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids",
                                             "past_key_values.0.key", "past_key_values.0.value",
                                             "past_key_values.1.key", "past_key_values.1.value"]
    assert [o.name for o in graph.output] == ["logits", "present.0.key", "present.0.value",
                                              "present.1.key", "present.1.value"]
    dims = [d.dim_param or d.dim_value for d in graph.input[3].type.tensor_type.shape.dim]
    assert dims == ["batch_size", 2, "past_sequence_length", 16]


def test_hf_keeps_its_own_cache_names(exported):
    graph = onnx.load(str(exported("qwen2", "hf", cache=True)), load_external_data=False).graph
    assert [i.name for i in graph.input][2:5] == ["position_ids", "input.cache.layers.0.keys",
                                                  "input.cache.layers.0.values"]
    assert [o.name for o in graph.output][-1] == "output.cache.layers.1.values"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_vary(tiny_model, family):
    tokens = factory.reference_generate(tiny_model(family), [5, 17, 42, 99], 32)
    assert len(tokens) == 32
    assert len(set(tokens)) >= 8, tokens


def test_build_is_deterministic_per_seed():
    a, b, c = (factory.build_model("llama", seed=s) for s in (0, 0, 1))
    wa, wb, wc = (m.model.layers[0].input_layernorm.weight.detach().numpy() for m in (a, b, c))
    assert np.array_equal(wa, wb) and not np.array_equal(wa, wc)
    assert a.config.tie_word_embeddings is False and a.model.layers[0].self_attn.q_proj.bias is None


def test_qwen2_tiny_config():
    config = factory.model_config("qwen2")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (64, 2, 4, 2, 128, 1000)
    assert config.tie_word_embeddings and factory.model_config("qwen2", "0.5b", layers=12).num_hidden_layers == 12


def test_example_qwen_tiny_exports_and_checks(tmp_path, capsys):
    """The README's first command: build, export (legacy17 + KV cache), check for SDK 6.0 and 9.0."""
    spec = importlib.util.spec_from_file_location("qwen_tiny", EXAMPLES / "qwen_tiny.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("== mtkc check --sdk") == 2 and "NeuroPilot 6.0" in out and "NeuroPilot 9.0" in out
    inputs = [i.name for i in onnx.load(str(tmp_path / "export" / "model.onnx"), load_external_data=False).graph.input]
    assert inputs[2:4] == ["position_ids", "past_key_values.0.key"]


def test_eager_attention_export(exported, tiny_model):
    """attn="eager": one float mask at model level, no IsNaN guard; still matches torch."""
    path = exported("llama", "legacy17", cache=True, attn="eager")
    ops = collections.Counter(n.op for n in _graph(path).nodes)
    assert ops["IsNaN"] == 0 and ops["Softmax"] == 2
    model = tiny_model("llama", "eager")
    feeds = [t.numpy() for t in factory.trace_inputs(model.config, True, batch=1, seq=1, past=9, seed=4)]
    got = _run(path, feeds)
    ref = factory.reference_logits(model, feeds[0], feeds[1], past=feeds[3:], position_ids=feeds[2])
    np.testing.assert_allclose(got["logits"], ref[0], atol=1e-4, rtol=1e-4)


def test_save_and_reload_reference(tmp_path, tiny_model):
    model = tiny_model("qwen2")
    again = factory.load_model(factory.save_model(model, tmp_path / "torch"))
    prompt = [7, 3, 250, 11, 900]
    assert factory.reference_generate(again, prompt, 8) == factory.reference_generate(model, prompt, 8)


def test_export_is_deterministic(exported, tiny_model, tmp_path):
    """A fresh export is byte-identical to the cached one (made by another process, possibly)."""
    fresh = factory.export(tiny_model("qwen2"), tmp_path, "legacy17", cache=True)
    assert fresh.read_bytes() == exported("qwen2", "legacy17", cache=True).read_bytes()


@pytest.mark.parametrize("exporter", ["legacy14", "dynamo"])
def test_export_leaves_the_model_as_it_was(tiny_model, tmp_path, exporter):
    """An export changes neither the model's weights and buffers nor its modules' eval mode: it is
    every later export's and reference's model (TorchScript's export used to leave it in train mode)."""
    model = copy.deepcopy(tiny_model("phi35"))
    modes = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    factory.export(model, tmp_path, exporter, cache=True)
    assert [m.training for m in model.modules()] == modes and not any(modes)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy17", "dynamo"])
def test_real_dims_two_layers(tmp_path, exporter):
    """Qwen2.5-0.5B dimensions (2 layers): logits reach |50|, so the tolerance is relative."""
    model = factory.build_model("qwen2", "0.5b", layers=2)
    path = factory.export(model, tmp_path, exporter, cache=True)
    feeds = [t.numpy() for t in factory.trace_inputs(model.config, True, batch=1, seq=3, past=4, seed=3)]
    got = _run(path, feeds)
    ref = factory.reference_logits(model, feeds[0], feeds[1], past=feeds[3:], position_ids=feeds[2])
    for name, want in zip(got, ref):
        np.testing.assert_allclose(got[name], want, atol=1e-3, rtol=1e-4, err_msg=name)
