"""kv-cache / kv-cache-io / layer-chunks: variants, cache I/O contract, numerics, refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from mtkc.analysis.cache import probe_length
from mtkc.analysis.decoder import decoder_map
from mtkc.analysis.regions import layer_boundaries
from mtkc.errors import InputError
from mtkc.ir import model as mmodel
from mtkc.options import of
from mtkc.passes import kv_cache
from mtkc.pipeline.compile import compile_model
from mtkc.rewrite.pass_api import Context
from mtkc.runtime.generate import Generator

T, C = 8, 64


def test_variants_prefill_decode_per_chunk(exported):
    graph = mmodel.load(exported("qwen2", "legacy17", cache=True)).graph
    plan = kv_cache.variants(graph, of({"seq_len": T, "cache_len": C, "chunks": 2, "cache_io": "sliding"}))
    assert [v.name for v in plan] == ["prefill_0", "prefill_1", "decode_0", "decode_1"]
    assert plan[1].options == {"kv_cache": True, "variant": "prefill", "seq_len": T, "cache_len": C,
                               "cache_io": "sliding", "chunks": 2, "chunk": 1, "max_positions": T + C}
    assert plan[2].options["seq_len"] == 1 and plan[2].options["max_positions"] == T + C
    defaults = kv_cache.variants(graph, of({}))
    assert [v.name for v in defaults] == ["prefill", "decode"]
    assert defaults[0].options["seq_len"] == 128 and defaults[0].options["cache_len"] == 512
    assert defaults[0].options["cache_io"] == "new"


def test_variants_model_without_cache_is_one_graph_unless_asked(exported):
    graph = mmodel.load(exported("qwen2", "legacy17", cache=False)).graph
    assert [v.name for v in kv_cache.variants(graph, of({"seq_len": T}))] == ["model"]
    assert [v.name for v in kv_cache.variants(graph, of({"kv_cache": True}))] == ["prefill", "decode"]
    assert [v.name for v in kv_cache.variants(graph, of({"kv_cache": False}))] == ["model"]


def test_variants_refuse_bad_options(exported):
    graph = mmodel.load(exported("qwen2", "legacy17", cache=True)).graph
    with pytest.raises(InputError, match="option 'cache_io': expected one of new, sliding, got 'ring'"):
        kv_cache.variants(graph, of({"cache_io": "ring"}))
    with pytest.raises(InputError, match=r"^--chunks 3: expected 1\.\.2 \(the model has 2 decoder layers\)$"):
        kv_cache.variants(graph, of({"chunks": 3}))
    with pytest.raises(InputError, match="chunks"):  # 0 never reaches the planner: Options refuses it
        of({"chunks": 0})


def test_chunk_ranges_split_as_evenly_as_possible():
    assert [len(r) for r in kv_cache.chunk_ranges(28, 3)] == [10, 9, 9]
    assert [(r.start, r.stop) for r in kv_cache.chunk_ranges(7, 3)] == [(0, 3), (3, 5), (5, 7)]
    assert [len(r) for r in kv_cache.chunk_ranges(24, 4)] == [6] * 4
    assert kv_cache.chunk_ranges(2, 2) == [range(1), range(1, 2)]


@pytest.mark.parametrize("exporter", ["legacy17", "dynamo", "hf"])
def test_kv_cache_names_cache_io_of_each_exporter(exported, exporter):
    model = mmodel.load(exported("qwen2", exporter, cache=True))
    graph = model.graph
    originals = [t.name for t in graph.inputs if t.shape is not None and len(t.shape) == 4]
    p = kv_cache.KvCache()
    result = p.run(graph, Context(None, {"kv_cache": True}, model.root))
    assert result.rewrites == 8  # 4 past inputs + 4 present outputs renamed
    assert kv_cache.KvCache().run(graph, Context(None, {"kv_cache": True}, model.root)).rewrites == 0
    names = [t.name for t in graph.inputs]
    assert [n for n in names if n.startswith("past_")] == ["past_key_0", "past_value_0", "past_key_1", "past_value_1"]
    assert [t.name for t in graph.outputs] == ["logits", "present_key_0", "present_value_0",
                                               "present_key_1", "present_value_1"]
    for i in range(2):  # each present is the layer's Concat(past, new, axis=2)
        concat = graph.outputs[1 + 2 * i].inputs[0]
        assert concat.op == "Concat" and concat.attrs["axis"] in (2, -2)
    assert set(p.map_feeds({n: 0 for n in originals}, None)) == {"past_key_0", "past_value_0", "past_key_1", "past_value_1"}


def test_kv_cache_refuses_a_model_without_attention(tmp_path):
    x = gs.Variable("x", np.float32, [1, 4])
    y = gs.Variable("y", np.float32, [1, 4])
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[y])], inputs=[x], outputs=[y], opset=17)
    onnx.save(gs.export_onnx(graph), tmp_path / "relu.onnx")
    with pytest.raises(InputError, match=r"no KV-cache inputs \(past_key_values\.\*\) and no attention"):
        compile_model(tmp_path / "relu.onnx", "8.0", tmp_path / "out", {"kv_cache": True, "seq_len": T, "cache_len": C})
    assert not (tmp_path / "out").exists()


def test_kv_cache_names_the_fused_op_of_a_packed_kv_entry(exported, tmp_path):
    """hf-ortfused: com.microsoft RotaryEmbedding makes K on packed [B, S, Hkv*D]; the refusal says so."""
    with pytest.raises(InputError, match=r"layer 0: the key entering attention at MatMul '\w+' is never a per-head "
                       r"\[B, Hkv, S, D\] tensor: .* \(made by fused op com\.microsoft RotaryEmbedding '\w+' on packed \[B, S, Hkv\*D\] K/V: "
                       r"export with cache I/O, or without ORT fusions\)$"):
        compile_model(exported("qwen2", "hf-ortfused", cache=False), "8.0", tmp_path / "out",
                      {"kv_cache": True, "cache_len": 16})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("exporter", ["legacy17", "dynamo", "hf"])
def test_mask_early_replaces_a_no_cache_exports_mask_before_the_cache_goes_in(exported, exporter, tmp_path):
    """--verify-each: the graph after mask-early ([1,1,T,T] additive mask) and after kv-cache (the
    mask widened to [1,1,T,C+T], empty cache slots masked) each compute the export's logits."""
    result = compile_model(exported("qwen2", exporter, cache=False), "8.0", tmp_path / "out",
                           {"seq_len": T, "cache_len": C, "kv_cache": True, "verify_each": True})
    names = [r.name for r in result.records]
    assert names.index("mask-early") < names.index("kv-cache")
    assert all(r.rewrites > 0 for r in result.records if r.name == "mask-early")  # prefill and decode
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    shapes = {g["name"]: {x["name"]: x["shape"] for x in g["inputs"]} for g in manifest["graphs"]}
    assert shapes["prefill"]["attention_mask"] == [1, 1, T, C + T] and shapes["decode"]["attention_mask"] == [1, 1, 1, C + 1]


def test_kv_cache_without_mask_early_names_the_missing_pass(exported, tmp_path):
    with pytest.raises(InputError, match="needs the mask-early pass before kv-cache .* add mask-early to --passes$"):
        compile_model(exported("qwen2", "legacy17", cache=False), "8.0", tmp_path / "out",
                      {"seq_len": T, "cache_len": C, "kv_cache": True, "passes": ["kv-cache", "bind-shapes"]})
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def hf_new(exported, tmp_path_factory):
    """An hf (transformers OnnxExporter) cache export compiled with new-entry presents, 1 chunk."""
    out = tmp_path_factory.mktemp("kv") / "hf-new"
    compile_model(exported("qwen2", "hf", cache=True), "8.0", out, {"seq_len": T, "cache_len": C})
    return out


def test_io_contract_of_the_compiled_graphs(hf_new):
    manifest = json.loads((hf_new / "manifest.json").read_text())
    graphs = {g["name"]: g for g in manifest["graphs"]}
    assert list(graphs) == ["prefill", "decode"]
    for name, t in (("prefill", T), ("decode", 1)):
        io = {x["name"]: (x["dtype"], x["shape"]) for x in graphs[name]["inputs"] + graphs[name]["outputs"]}
        assert [x["name"] for x in graphs[name]["inputs"]] == [
            "hidden_states", "attention_mask", "position_ids", "past_key_0", "past_value_0", "past_key_1", "past_value_1"]
        assert io["hidden_states"] == ("float32", [1, t, 64])
        assert io["attention_mask"] == ("float32", [1, 1, t, C + t])
        assert io["position_ids"] == ("int32", [1, t])
        assert io["past_value_1"] == ("float32", [1, 2, C, 16])
        assert io["logits"] == ("float32", [1, t, 1000])
        assert io["present_key_0"] == ("float32", [1, 2, t, 16])  # new entries only


def test_prefill_matches_torch_logits_and_new_cache_entries(hf_new, tiny_model):
    prompt = [5, 17, 300, 42, 7]
    generator = Generator(hf_new)
    generator.reset()
    logits = generator.step(generator.prefill, prompt)
    with torch.no_grad():
        out = tiny_model("qwen2")(torch.tensor([prompt]), use_cache=True)
    np.testing.assert_allclose(logits, out.logits[0].numpy(), atol=1e-4)
    for i, layer in enumerate(out.past_key_values.layers):
        np.testing.assert_allclose(generator.cache[f"past_key_{i}"][:, :, :5], layer.keys.numpy(), atol=1e-5)
        np.testing.assert_allclose(generator.cache[f"past_value_{i}"][:, :, :5], layer.values.numpy(), atol=1e-5)
        assert not generator.cache[f"past_key_{i}"][:, :, 5:].any()  # padded rows are not written


def test_weights_are_written_once_for_prefill_and_decode(hf_new, exported):
    source = onnx.load(str(exported("qwen2", "hf", cache=True)))
    stored = sum(onnx.numpy_helper.to_array(t).nbytes for t in source.graph.initializer)
    written = (hf_new / "weights.bin").stat().st_size
    assert written < 1.2 * stored  # one copy (2 graphs), plus small constants


def test_kv_cache_io_map_outputs_keeps_what_the_runtime_keeps():
    full = np.arange(1 * 2 * (C + T) * 4, dtype=np.float32).reshape(1, 2, C + T, 4)
    for mode, expected in (("new", full[:, :, C:]), ("sliding", full[:, :, T:])):
        ctx = Context(None, {"kv_cache": True, "seq_len": T, "cache_len": C, "cache_io": mode})
        mapped = kv_cache.KvCacheIo().map_outputs({"present_key_0": full, "logits": full}, ctx)
        assert np.array_equal(mapped["present_key_0"], expected) and mapped["logits"] is full


def test_layer_boundaries_are_the_residual_stream(exported):
    model = mmodel.load(exported("llama", "legacy17", cache=True))
    graph = model.graph
    kv_cache.KvCache().run(graph, Context(None, {"kv_cache": True}, model.root))
    bounds = layer_boundaries(graph, decoder_map(graph))
    assert set(bounds) == {0, 1}
    assert bounds[0] is not bounds[1]
    # layer 1's boundary: the residual stream after layer 0's MLP Add; TorchScript starts layer 1's
    # RMSNorm with a no-op Cast that both the norm and the residual read, so that Cast is the cut
    node = bounds[1].inputs[0]
    assert (node.op, node.name) == ("Cast", "/m/model/layers.1/input_layernorm/Cast")
    assert node.inputs[0].inputs[0].op == "Add" and "layers.0/" in node.inputs[0].inputs[0].name


def test_uneven_chunks_generate_the_same_tokens(tmp_path):
    """3 layers in 2 chunks: layers 0-1 and 2 (the quantisation units numbered so too); greedy tokens
    still equal transformers'."""
    import factory

    model = factory.build_model("qwen2", "tiny", seed=0, layers=3)
    source = factory.export(model, tmp_path / "src", "legacy17", cache=True)
    out = tmp_path / "out"
    compile_model(source, "8.0", out, {"seq_len": T, "cache_len": C, "chunks": 2})
    manifest = json.loads((out / "manifest.json").read_text())
    presents = {g["name"]: sorted(o["name"] for o in g["outputs"] if o["name"].startswith("present_key"))
                for g in manifest["graphs"]}
    assert presents["prefill_0"] == ["present_key_0", "present_key_1"] and presents["prefill_1"] == ["present_key_2"]
    units = {g["name"]: ([x["index"] for x in g["decoder"]["layers"]], g["decoder"]["lm_head"]) for g in manifest["graphs"]}
    assert units["prefill_0"] == ([0, 1], None) and units["prefill_1"][0] == [2] and units["prefill_1"][1]  # by past_key_i
    prompt = [5, 17, 300, 42, 7, 9, 11, 13, 15, 200]
    assert Generator(out).generate(prompt, 8) == factory.reference_generate(model, prompt, 8)


def test_a_model_dimension_equal_to_the_probe_length_is_told_apart(tmp_path, run_cli):
    """97 kv heads (the first probe length) behind TorchScript's `view(..., -1, head_dim)`: only
    inference finds that dim, so the probe of the cache insert saw [1, 97, 2, 97, 2] at GQA's Expand
    and refused ("cannot tell the sequence axis"); a second probe at another length tells them apart.
    The compiled graphs match the export (verify's oracle)."""
    import factory
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=388, num_hidden_layers=1, num_attention_heads=194, num_key_value_heads=97,
                         intermediate_size=64, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    source = factory.export(model, tmp_path / "src", "legacy17", cache=False)
    assert probe_length(gs.import_onnx(onnx.load(str(source), load_external_data=False))) == 97
    out = tmp_path / "out"
    compile_model(source, "8.0", out, {"seq_len": T, "cache_len": C, "kv_cache": True})
    code, _, err = run_cli("verify", out, "--samples", 1)
    assert code == 0, err


def test_the_probe_length_is_no_declared_dim_or_small_constant():
    x = gs.Variable("x", np.float32, ["s", 97])
    shape = gs.Constant("shape", np.array([1, 98, -1], np.int64))
    y = gs.Variable("y", np.float32, None)
    graph = gs.Graph([gs.Node("Reshape", inputs=[x, shape], outputs=[y])], [x], [y])
    assert probe_length(graph) == 99 and probe_length(graph, start=100) == 100
