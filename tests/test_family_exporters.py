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

from mtkc import cli

T, C, NEW = 8, 64, 16
PROMPTS = {"short": [5, 17, 300], "long": list(range(40, 53))}
OPTS = ("--seq-len", T, "--cache-len", C)


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
