"""DecoderMap on every exporter of the test set, and a layer it does not recognise.

Per layer: q/k/v projections, scores/PV (or the fused attention op), norms, residual in/out, the
MLP kind, the cache concat of each kind; the numbering agrees with the kv-cache detector's
(`find_caches`: layer i reads the same past inputs). A Softmax that is not where a decoder's is
becomes a per-layer refusal that `mtkc check` prints, with exit 0.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from mtkc.analysis.decoder import decoder_map
from mtkc.analysis.regions import layer_regions
from mtkc.ir.model import load
from mtkc.manager.pass_manager import resolve_pipeline, run_pipeline
from mtkc.pipeline.registry import load_registry
from mtkc.options import of
from mtkc.analysis.cache import find_caches, layer_caches
from mtkc.passes.kv_cache.plan import chunk_ranges, variants
from mtkc.rewrite.pass_api import Context
from mtkc.target.capability import load_table

QWEN = ["legacy14", "legacy17", "dynamo", "hf", "hf-ortfused", "dynamo-ortfused", "ortopt", "hf-generate",
        "dynamo-cacheobj", "genai-fp32", "genai-int4", "genai-int4-acc1"]
CASES = [("qwen2", e, True) for e in QWEN] + [("qwen2", e, False) for e in QWEN[:7]] \
    + [("llama", e, True) for e in ("legacy17", "dynamo", "hf", "hf-ortfused", "ortopt", "genai-fp32")]
FUSED = {"genai-fp32": "GroupQueryAttention", "genai-int4": "GroupQueryAttention",
         "genai-int4-acc1": "GroupQueryAttention", "dynamo-ortfused": "MultiHeadAttention"}


@pytest.mark.parametrize("family,exporter,cache", CASES)
def test_every_exporter_maps_two_layers(exported, family, exporter, cache):
    graph = load(exported(family, exporter, cache)).graph
    dm = decoder_map(graph)
    assert [x.refused for x in dm.refused] == [] and len(dm.layers) == 2
    attention = FUSED.get(exporter, "softmax")
    for i, layer in enumerate(dm.layers):
        assert (layer.index, layer.attention, layer.mlp) == (i, attention, "SwiGLU")
        assert layer.q and layer.k and layer.v and len(layer.norms) == 2 and layer.rope
        assert layer.residual_in and (layer.residual_out or i == 1 and "Skip" in dm.final_norm)
        if attention == "softmax":
            assert layer.scores and layer.pv and layer.mask and layer.softcap is None
        assert set(layer.cache) == ({"key", "value"} if cache else set())
    assert dm.token_input == "input_ids" and dm.embedding and dm.logits and dm.final_norm
    assert dm.mask_source == ("attention_mask" if exporter != "hf-generate" else None) and (dm.cache_layout != "none") == cache
    if cache and attention == "softmax":  # one layer numbering: the kv-cache detector's
        assert [x.past for x in dm.layers] == \
            [{k: t.name for k, t in layer.past.items()} for layer in find_caches(graph)]
        names = dm.contract_names(graph)  # verify's pairing of the export's I/O with the compiled graph's
        assert set(names.values()) - {"logits"} == \
            {f"{io}_{k}_{i}" for io in ("past", "present") for k in ("key", "value") for i in range(2)}
    json.dumps(dm.to_json())


def _clipped(exported, tmp_path, cache: bool):
    """The tiny Qwen2 legacy17 export with a Clip between layer 1's mask and its Softmax."""
    graph = gs.import_onnx(onnx.load(str(exported("qwen2", "legacy17", cache))))
    softmax = [n for n in graph.nodes if n.op == "Softmax"][1]
    clipped = gs.Variable("clipped", softmax.inputs[0].dtype, softmax.inputs[0].shape)
    graph.nodes.append(gs.Node("Clip", "odd/Clip", inputs=[softmax.inputs[0]], outputs=[clipped]))
    softmax.inputs[0] = clipped
    path = tmp_path / ("cache" if cache else "nocache") / "model.onnx"
    path.parent.mkdir()
    onnx.save(gs.export_onnx(graph.toposort()), str(path))
    reason = f"Softmax '{softmax.name}': Clip 'odd/Clip' between the scores and the Softmax " \
        "(expected MatMul(Q, Kᵀ) through scale, soft-cap, mask)"
    return path, softmax.name, reason


def test_an_unrecognised_layer_is_refused_with_its_reason(exported, run_cli, tmp_path):
    """Layer 0 stays, layer 1 is refused, check exits 0."""
    path, anchor, reason = _clipped(exported, tmp_path, False)
    code, out, err = run_cli("check", path, "--sdk", "8.0", "--format", "json", "--seq-len", "8")
    assert code == 0, err
    decoder = json.loads(out)["decoder"]
    assert decoder["layers"] == 1 and [x["anchor"] for x in decoder["refused"]] == [anchor]
    assert decoder["refused"][0] == {"index": 1, "anchor": anchor, "block": "scores", "refused": reason}
    code, out, err = run_cli("check", path, "--sdk", "8.0", "--seq-len", "8")
    assert code == 0 and "decoder     Qwen2/Llama-style, 1 layers (1×attention+SwiGLU); cache none; 1 refused\n" \
        "            layer 0: 2 norms, q/k/v, rope, sdpa, SwiGLU\n" \
        f"            layer 1: scores refused: {reason}\n" in out, out + err


@pytest.mark.parametrize("cache", [True, False], ids=["cache-export", "kv-cache-inserted"])
def test_compile_refuses_an_unrecognised_layer_with_the_maps_reason(exported, run_cli, tmp_path, cache):
    """The kv-cache passes read the map: a refused layer is exit 2 naming it, its block and the reason
    (before: a cache export stopped with "its Concat ... feeds no attention", and `--kv-cache` on a
    no-cache export silently left the refused layer without cache, so decode saw no past)."""
    path, anchor, reason = _clipped(exported, tmp_path, cache)
    out = tmp_path / "out"
    code, _, err = run_cli("compile", path, "--sdk", "8.0", "--seq-len", "8", "--cache-len", "16", "--no-convert",
                           "-o", out, *([] if cache else ["--kv-cache"]))
    assert code == 2 and not out.exists(), err
    assert f"mtkc: error: decoder layer 1 ('{anchor}'): scores refused: {reason}; " in err, err
    assert "feeds no attention" not in err and len(err.strip().splitlines()) == 1, err


def test_without_a_cache_the_refused_layer_compiles_and_explain_names_it(exported, run_cli, tmp_path):
    """No cache to place: the layer the map refused compiles as it is (its Clip on the CPU), and
    `--explain` prints the map's refusal after the pass's misses."""
    path, anchor, reason = _clipped(exported, tmp_path, False)
    code, out, err = run_cli("compile", path, "--sdk", "8.0", "--seq-len", "8", "--no-convert", "-o", tmp_path / "out",
                             "--explain", "attention")
    assert code == 0, err
    assert out.endswith(f"\ndecoder layer 1 ('{anchor}'): scores refused: {reason}\n") and "odd/Clip" in out, out
    assert "mtkc: CPU: Clip x1 (op-not-in-table" in err, err


def test_one_layer_numbering_before_and_after_the_pipeline(exported):
    """Layer i is the same layer for the map, the kv-cache detector (`past_key_i`), `--chunks`
    (plan/chunks read the map) and the quantisation units (`mtkc.analysis.regions`: layer i's attention
    is in region i)."""
    model = load(exported("qwen2", "legacy17", True))
    raw = decoder_map(model.graph)
    regions = layer_regions(model.graph, raw)
    assert [[i for i, r in regions.items() if x.anchor in {n.name for n in r.nodes}] for x in raw.layers] == [[0], [1]]
    assert [x.past for x in raw.layers] == [{k: t.name for k, t in c.past.items()} for c in find_caches(model.graph)]
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    ctx = Context(load_table("8.0"), dict(seq_len=8, cache_len=16, kv_cache=True, variant="prefill"),
                  model.root, model.values)
    run_pipeline(graph, resolve_pipeline(load_registry(), ctx, None, ["layer-chunks"]), ctx)
    compiled = ctx.analysis(decoder_map, graph)
    assert [x.anchor for x in compiled.refused] == [] and \
        [(c.index, c.past["key"].name) for c in layer_caches(graph, compiled)] == [(0, "past_key_0"), (1, "past_key_1")]
    assert [len(r) for r in chunk_ranges(len(compiled.layers), 2)] == [1, 1]
    assert [v.name for v in variants(model.graph, of({"chunks": 2}))] == ["prefill_0", "prefill_1", "decode_0", "decode_1"]


def test_attention_soft_capping_is_part_of_the_layer(exported):
    """Gemma 2's scores soft-cap, cap * tanh(scores / cap), between the scores and the mask."""
    graph = gs.import_onnx(onnx.load(str(exported("qwen2", "legacy17", False)), load_external_data=False))
    tanhs = []
    for layer in decoder_map(graph).layers:
        scores = layer.nodes[layer.scores].outputs[0]
        users = list(scores.outputs)
        cap = gs.Constant(f"{layer.scores}/cap", np.array(50.0, np.float32))
        x, y, z = (gs.Variable(f"{layer.scores}/{n}", np.float32) for n in ("div", "tanh", "capped"))
        tanhs.append(gs.Node("Tanh", f"{layer.scores}/Tanh", inputs=[x], outputs=[y]))
        graph.nodes += [gs.Node("Div", inputs=[scores, cap], outputs=[x]), tanhs[-1],
                        gs.Node("Mul", inputs=[y, cap], outputs=[z])]
        for user in users:
            user.inputs = [z if t is scores else t for t in user.inputs]
    dm = decoder_map(graph.toposort())
    assert [x.softcap for x in dm.layers] == [n.name for n in tanhs] and not dm.refused
    assert all(x.mask and x.scores and x.scale is None for x in dm.layers)  # cap * tanh(s / cap) is no scale


FAMILIES = {"qwen2": "Qwen2/Llama-style", "llama": "Qwen2/Llama-style", "mistral": "Qwen2/Llama-style",
            "llama3": "Qwen2/Llama-style", "qwen3": "Qwen3", "gemma2": "Gemma 2", "gemma3": "Gemma 3",
            "phi3": "Phi-3/Phi-3.5", "phi35": "Phi-3/Phi-3.5", "phi4mini": "Phi-4-mini"}
BLOCKS = {"qwen3": "layers 0-1: 2 norms, q/k/v, q/k norm, rope, sdpa, cache, SwiGLU",
          "gemma2": "layers 0-1: 4 norms (sandwich), q/k/v, rope, sdpa, soft-cap, cache, GeGLU",
          "gemma3": "layers 0-5: 4 norms (sandwich), q/k/v, q/k norm, rope, sdpa, cache, GeGLU",
          "phi4mini": "layers 0-1: 2 norms, fused qkv, partial rope, sdpa, cache, SwiGLU (fused gate-up)"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_is_recognised_from_structure(exported, family):
    """transformers' dynamo export of each factory family: the family its layers' structure says
    (q/k norm, soft-cap, GeGLU, sandwich norms, fused qkv, partial rotary), identical layers grouped."""
    dm = decoder_map(load(exported(family, "hf", True)).graph)
    assert dm.family == FAMILIES[family] and dm.to_json()["family"] == FAMILIES[family] and not dm.refused
    assert dm.per_layer() == [BLOCKS.get(family, "layers 0-1: 2 norms, fused qkv, rope, sdpa, cache, SwiGLU (fused gate-up)"
                                         if family.startswith("phi") else "layers 0-1: 2 norms, q/k/v, rope, sdpa, cache, SwiGLU")]


def test_a_packing_exporter_is_no_family_evidence(exported):
    """onnxruntime-genai packs q/k/v for every family: without another signature the family is unknown."""
    assert decoder_map(load(exported("qwen2", "genai-fp32", True)).graph).family == "decoder (unknown family)"
    assert decoder_map(load(exported("qwen3", "genai-fp32", True)).graph).family == "Qwen3"  # q/k norm still says it
