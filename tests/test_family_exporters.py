"""Issue 19, the family x exporter matrix: each family through the exporters that support it
(transformers' exporter, dynamo with a DynamicCache argument, TorchScript opset 14, onnxruntime-genai's
builder, Optimum), compiled for SDK 8.0 (every node on the NPU) and 6.0 (CPU nodes with reasons),
`verify` exit 0, and 16 greedy tokens on a prompt shorter and one longer than T (and than the
sliding window) equal to transformers' `generate` -- onnxruntime-genai's `Generator` for its exports.

And what mtkc cannot compile is exit 2 naming the layer and the block: onnxruntime-genai's Gemma 2
(GroupQueryAttention with softcap and a window-sized cache), an attention reading a cache that the
decoder analysis does not recognise; remedies name the model's own inputs.
"""

from __future__ import annotations

import json

import onnx
import pytest

import factory
from mtkc import cli
from mtkc.pipeline import verify as V
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import Generator

T, C, NEW = 8, 64, 16
PROMPTS = {"short": [5, 17, 300], "long": list(range(40, 53))}
OPTS = ("--seq-len", T, "--cache-len", C)


# (family, exporter, cache): the first of each family runs in the default suite, the rest are slow.
DEFAULT = [("qwen3", "genai-fp32", True), ("mistral", "hf", True), ("gemma2", "hf", True), ("gemma3", "hf", True),
           ("phi3", "genai-fp32", True), ("phi35", "genai-fp32", True), ("phi4mini", "legacy14", False),
           ("llama3", "genai-fp32", True)]
MORE = [(f, "hf", True) for f in ("qwen3", "phi3", "phi35", "phi4mini", "llama3")] \
    + [(f, "dynamo-cacheobj", True) for f in ("qwen3", "phi3", "phi35", "phi4mini", "llama3")] \
    + [(f, "legacy14", False) for f in ("qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi35", "llama3")] \
    + [(f, e, True) for f in ("qwen3", "phi3", "phi35", "phi4mini", "llama3") for e in ("dynamo", "legacy14")] \
    + [(f, "legacy17", True) for f in ("phi35", "phi4mini")] \
    + [(f, "optimum", True) for f in ("qwen3", "mistral", "phi3")] + [("qwen3", "genai-int4", True)] \
    + [(f, "genai-int4-acc1", True) for f in ("phi3", "phi35", "llama3")]  # og at the builder's default level 4
# rounds activations to int8 and picks other near-tied tokens (test_exporters): level 1 is the exact reference
# Not here, with why (the closing note's table): the sliding families' TorchScript / dynamo cache exports
# (cropped DynamicSlidingWindowLayer presents: refused naming the layer; dynamo with named Dims fails
# itself, "Constraints violated (past_sequence_length)"); genai Gemma 2 (refused naming the layer), Gemma 3
# (the builder: KeyError 'rope_type'), Mistral (the builder drops the window; og fails on the long prompt);
# optimum's Gemma 2/3, Phi-3.5, Phi-4-mini, Llama 3 (the transformers 4.57 side venv reads no rope scaling
# from a transformers 5 config, so those exports are another model; mtkc equals them: verify ok).
CASES = [pytest.param(*c, id="-".join(c[:2])) for c in DEFAULT] \
    + [pytest.param(*c, id="-".join(c[:2]), marks=pytest.mark.slow) for c in MORE]


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """`compiled(family, exporter, cache, sdk)` -> OUT (no-cache exports with --kv-cache), once per module."""
    outs = {}

    def get(family, exporter, cache, sdk):
        key = (family, exporter, cache, sdk)
        if key not in outs:
            out = tmp_path_factory.mktemp("matrix") / "-".join(map(str, key))
            compile_model(exported(family, exporter, cache), sdk, out,
                          {"seq_len": T, "cache_len": C, "kv_cache": True if not cache else None})
            outs[key] = out
        return outs[key]

    return get


@pytest.fixture(scope="module")
def reference(reference_tokens):
    """`reference(family, exporter, cache, prompt)` -> transformers' greedy tokens, or
    onnxruntime-genai's `Generator` on (a copy of) the export's own files for its exports."""
    return lambda family, exporter, cache, prompt: reference_tokens(family, exporter, cache, PROMPTS[prompt], NEW)


@pytest.mark.parametrize("family,exporter,cache", CASES)
def test_family_through_exporter(family, exporter, cache, compiled, reference):
    """SDK 8.0: one NPU partition per graph (prefill, decode); 6.0: every CPU node has its reason;
    verify passes; both SDKs' greedy tokens equal the reference on a short and a long prompt."""
    out8 = compiled(family, exporter, cache, "8.0")
    manifest = json.loads((out8 / "manifest.json").read_text())
    assert {g["name"]: [p["target"] for p in g["partitions"]] for g in manifest["graphs"]} == \
        {"prefill": ["npu"], "decode": ["npu"]}
    report = json.loads((compiled(family, exporter, cache, "6.0") / "report.json").read_text())
    for name, graph in report["placement"].items():
        assert graph["cpu_nodes"] == len(graph["cpu"]) and all(c["reason"] for c in graph["cpu"]), name
    result = V.verify(out8, samples=1)
    assert result.ok, V.format_text(result)
    for sdk in ("8.0", "6.0"):
        generator = Generator(compiled(family, exporter, cache, sdk))
        for prompt, ids in PROMPTS.items():
            tokens = generator.generate(ids, NEW)
            assert tokens == reference(family, exporter, cache, prompt), f"SDK {sdk}, {prompt} prompt"
            assert len(set(tokens)) > NEW // 2


def mtkc(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_genai_gemma2_is_refused_naming_the_layer_and_block(capsys, exported, tmp_path):
    """Its GroupQueryAttention keeps a window-sized cache inside the op and soft-caps the scores:
    exit 2 naming layer 0 and both (was: "no KV-cache inputs (past_key_values.*)", which it has)."""
    code, _, err = mtkc(capsys, "compile", exported("gemma2", "genai-fp32", cache=True), "--sdk", "8.0", *OPTS,
                        "-o", tmp_path / "out")
    assert code == 2, err
    assert ("layer 0: GroupQueryAttention '/model/layers.0/attn/GroupQueryAttention' (its cache inside the op): "
            "local window 8 on a window-sized cache (sliding_window_cache) and softcap 20 are not decomposed") in err
    assert "no KV-cache inputs" not in err and not (tmp_path / "out").exists()


def test_an_unrecognised_attention_reading_a_cache_is_refused(capsys, exported, tmp_path):
    """A cache read by an attention the decoder analysis refuses (here an op it does not know between
    the QKV projection and the GroupQueryAttention) was compiled as one static graph with the cache as
    plain inputs (exit 0, generate then failed): exit 2 naming the layer and why."""
    model = onnx.load(exported("qwen2", "genai-fp32", cache=True))
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    relu = onnx.helper.make_node("Relu", [gqa.input[0]], ["unknown_op_out"], name="unknown_op")
    gqa.input[0] = "unknown_op_out"
    model.graph.node.insert(list(model.graph.node).index(gqa), relu)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    code, _, err = mtkc(capsys, "compile", path, "--sdk", "8.0", *OPTS, "-o", tmp_path / "out")
    assert code == 2, err
    assert ("layer 0 (attention '/model/layers.0/attn/GroupQueryAttention') reads cache input 'past_key_values.0.key' "
            "but is not a decoder layer mtkc recognises: GroupQueryAttention '/model/layers.0/attn/GroupQueryAttention': "
            "no query projection") in err
    assert not (tmp_path / "out").exists()
    code, _, err = mtkc(capsys, "compile", path, "--sdk", "8.0", "--seq-len", T, "--no-kv-cache", "-o", tmp_path / "flat")
    assert code == 0, err  # asked for: the cache inputs stay inputs


def test_input_shape_takes_the_models_cache_names(capsys, exported, tmp_path):
    """--input-shape binds a cache input by the model's own name in the prefill/decode graphs (where
    kv-cache renamed it past_key_0); the contract name is not the model's; a conflict names the model's."""
    source = exported("qwen2", "legacy17", cache=True)
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", source, "--sdk", "8.0", *OPTS, "--input-shape",
                        "past_key_values.0.key=1,2,64,16", "-o", out)
    assert code == 0, err
    decode = json.loads((out / "manifest.json").read_text())["graphs"][1]
    assert {i["name"]: i["shape"] for i in decode["inputs"]}["past_key_0"] == [1, 2, C, 16]
    code, _, err = mtkc(capsys, "compile", source, "--sdk", "8.0", *OPTS, "--input-shape", "past_key_0=1,2,64,16",
                        "-o", tmp_path / "bad")
    assert code == 2 and "the model has no input 'past_key_0'" in err, err
    code, _, err = mtkc(capsys, "compile", source, "--sdk", "8.0", *OPTS, "--input-shape",
                        "past_key_values.0.key=1,2,64,8", "-o", tmp_path / "bad")
    assert code == 2 and "input 'past_key_values.0.key' is 16, cannot bind it to 8 (--input-shape)" in err, err


def test_an_unbound_dim_names_the_models_input():
    """The still-dynamic error of a graph whose cache kv-cache renamed names the model's input (the
    name --input-shape takes), and the compiled graph's name beside it."""
    import numpy as np
    import onnx_graphsurgeon as gs

    from mtkc.errors import InputError
    from mtkc.pipeline.build import _require_static
    from mtkc.rewrite.pass_api import Context

    graph = gs.Graph(inputs=[gs.Variable("past_key_0", np.float32, [1, "kv_cache_dim", 64, 16])])
    with pytest.raises(InputError, match=r"^input 'past_key_values\.0\.key' \(past_key_0 in the compiled graph\): "
                                         r"dim 'kv_cache_dim' .* --input-shape past_key_values\.0\.key="):
        _require_static(graph, Context(None, renamed={"past_key_0": "past_key_values.0.key"}))


def test_genai_mistral_says_its_window_was_dropped(capsys, exported, reference, tmp_path):
    """onnxruntime-genai's builder writes Mistral without its window (local_window_size -1, while
    genai_config.json declares window 8; og.Generator itself fails on the long prompt, its pre-allocated
    present): compile says so; the graphs are the export's (og's 16 tokens on the short prompt)."""
    out = tmp_path / "out"
    code, _, err = mtkc(capsys, "compile", exported("mistral", "genai-fp32", cache=True), "--sdk", "8.0", *OPTS,
                        "-o", out)
    assert code == 0, err
    assert "genai_config.json declares a sliding window of 8, but no GroupQueryAttention applies one" in err
    assert Generator(out).generate(PROMPTS["short"], NEW) == reference("mistral", "genai-fp32", True, "short")


def test_torchscript_long_rope_keeps_the_switch(exported, tiny_model):
    """TorchScript exports Phi-3.5's long-rope (transformers' in-place inv_freq.copy_ was 'aten::copy'
    at opset 17): the long/short switch stays in the graph, so onnxruntime equals torch on both sides
    of original_max_position_embeddings (256)."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(exported("phi35", "legacy17", cache=False)))
    model = tiny_model("phi35")
    for seq in (5, 300):
        ids, mask = factory.trace_inputs(model.config, False, batch=1, seq=seq)
        got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        assert np.abs(got - factory.reference_logits(model, ids, mask)).max() < 1e-3, seq


def test_cache_export_without_positions_gets_a_position_input(exported, tmp_path):
    """Optimum's Gemma 2 (transformers 4.57) has a cache but no position_ids input: RoPE counted
    positions from the past's length, which a static cache fixes at C (verify: tokens differed from
    the export's own, cosine 0.24). The positions become an input; verify equals the export."""
    out = tmp_path / "out"
    compile_model(exported("gemma2", "optimum", cache=True), "8.0", out, {"seq_len": T, "cache_len": C})
    decode = json.loads((out / "manifest.json").read_text())["graphs"][1]
    assert "position_ids" in [i["name"] for i in decode["inputs"]]
    result = V.verify(out, samples=1)
    assert result.ok, V.format_text(result)


def test_genai_partial_rotary_behind_the_rope_switch(exported, tiny_model, tmp_path):
    """onnxruntime-genai's Phi-4-mini: partial rotary (12 of 16 dims) with the cos cache made by the
    long/short If (declared ['max_sequence_length', 'head_dim / 2']): the rotary width is read off the
    If's branches (was: the whole head rotated, then 'kv_cache_dim is still dynamic'). The tiny export
    itself does not run in onnxruntime (GroupQueryAttention wants the cos width a multiple of 8), so the
    reference is transformers: 16 tokens on both prompts."""
    from mtkc.errors import MismatchError

    out = tmp_path / "out"
    compile_model(exported("phi4mini", "genai-fp32", cache=True), "8.0", out, {"seq_len": T, "cache_len": C})
    generator = Generator(out)
    for ids in PROMPTS.values():
        assert generator.generate(ids, NEW) == factory.reference_generate(tiny_model("phi4mini"), ids, NEW)
    with pytest.raises(MismatchError, match="the original export does not run in onnxruntime.*multiple of 8"):
        V.verify(out, samples=1)
