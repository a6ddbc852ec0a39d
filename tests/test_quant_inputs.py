"""Already-quantised inputs: onnxruntime's quantize_static (QDQ) and quantize_dynamic outputs.

The tiny Qwen2 (legacy17, no cache) is quantised in the test with onnxruntime's own tools: static
QDQ per tensor and per channel keep every QuantizeLinear/DequantizeLinear on the NPU and compute
exactly what the input computes; quantize_dynamic's DynamicQuantizeLinear + MatMulInteger become
MatMul on DequantizeLinear(int8 weight), all NPU. `check` reports each model's state.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from mtkc.contract import mask as contract_mask
from mtkc.ir import execute
from mtkc.passes.qdq import DynamicQuant, quantization_state
from mtkc.pipeline.compile import compile_model

SEQ = 8


class _Reader:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.data = [{"input_ids": rng.integers(0, 1000, (1, SEQ)), "attention_mask": np.ones((1, SEQ), np.int64)}
                     for _ in range(3)]

    def get_next(self):
        return self.data.pop() if self.data else None


@pytest.fixture(scope="module")
def quantized(exported, tmp_path_factory):
    """{"static-tensor", "static-channel", "dynamic-tensor", "dynamic-channel": model path} (+ "float")."""
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static

    source = exported("qwen2", "legacy17", False)
    folder = tmp_path_factory.mktemp("qin")
    paths = {"float": source}
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        for per_channel in (False, True):
            kind = "channel" if per_channel else "tensor"
            paths[f"static-{kind}"] = folder / f"static-{kind}.onnx"
            quantize_static(str(source), str(paths[f"static-{kind}"]), _Reader(), quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, op_types_to_quantize=["MatMul"])
            paths[f"dynamic-{kind}"] = folder / f"dynamic-{kind}.onnx"
            quantize_dynamic(str(source), str(paths[f"dynamic-{kind}"]), per_channel=per_channel, op_types_to_quantize=["MatMul"])
    finally:
        logging.getLogger().setLevel(level)
    return paths


def _compiled(path, out):
    compile_model(path, "8.0", out, {"seq_len": SEQ})
    manifest = json.loads((out / "manifest.json").read_text())
    parts = manifest["graphs"][0]["partitions"]
    return manifest, parts, Counter(n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node)


def _logits(path, feeds):
    model = onnx.load(str(path))
    return execute.run(model, feeds, path.parent)["logits"]


def _feeds(vocab=1000):
    ids = np.random.default_rng(1).integers(0, vocab, (1, SEQ))
    return ids


@pytest.mark.parametrize("kind", ["static-tensor", "static-channel"])
def test_static_qdq_stays_on_the_npu_and_computes_the_same(kind, quantized, tmp_path, run_cli):
    before = Counter(n.op_type for n in onnx.load(str(quantized[kind])).graph.node)
    manifest, parts, ops = _compiled(quantized[kind], tmp_path / "out")
    assert [p["target"] for p in parts] == ["npu"]
    assert ops["QuantizeLinear"] == before["QuantizeLinear"] and ops["DequantizeLinear"] == before["DequantizeLinear"]
    code, stdout, err = run_cli("verify", tmp_path / "out", "--samples", 2, "--format", "json")
    assert code == 0, err
    assert all(c["max_abs"] < 1e-4 for c in json.loads(stdout)["checks"])


@pytest.mark.parametrize("kind", ["dynamic-tensor", "dynamic-channel"])
def test_dynamic_quant_becomes_dequantized_int8_weights_on_the_npu(kind, quantized, tmp_path):
    manifest, parts, ops = _compiled(quantized[kind], tmp_path / "out")
    assert [p["target"] for p in parts] == ["npu"]
    assert "MatMulInteger" not in ops and "DynamicQuantizeLinear" not in ops
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    weights = {i.name: i for i in graph.initializer}
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 15 and all(weights[n.input[0]].data_type == TensorProto.INT8 for n in dq)
    # the compiled graph vs the float export: only the int8 weight rounding is left
    ids = _feeds()
    compiled = execute.run(onnx.load(str(tmp_path / "out" / "model.onnx")), _host_inputs(tmp_path / "out", ids),
                           tmp_path / "out")["logits"]
    reference = _logits(quantized["float"], {"input_ids": ids, "attention_mask": np.ones((1, SEQ), np.int64)})
    a, b = compiled.ravel().astype(np.float64), reference.ravel().astype(np.float64)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.995


def _host_inputs(out, ids):
    """The compiled graph's other inputs (host embedding rows, additive causal mask, positions)."""
    manifest = json.loads((out / "manifest.json").read_text())
    feeds = {}
    for spec in manifest["graphs"][0]["inputs"]:
        if spec["name"] == "hidden_states":
            feeds["hidden_states"] = np.load(out / manifest["host"]["embedding"]["path"])[ids[0]][None]
        elif spec["name"] == "attention_mask":
            value = contract_mask.value_of(manifest["options"])
            feeds["attention_mask"] = contract_mask.additive(SEQ, spec["shape"][3], value)[None, None]
        elif spec["name"] == "position_ids":
            feeds["position_ids"] = np.arange(SEQ, dtype=np.int32)[None]
        elif spec["name"] == "input_ids":
            feeds["input_ids"] = ids.astype(np.int32)
    return feeds


def _dynamic_graph(per_channel: bool, fed_by_dql: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    wq = rng.integers(-64, 64, (16, 8)).astype(np.int8)  # 7-bit, as quantize_dynamic: u8 x s8 pairs saturate int16 in ORT
    ws = (rng.random(8 if per_channel else ()) * 0.02 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.array(3, np.int8), "wzp")]
    if fed_by_dql:
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"], name="dql")]
        extra_inputs = []
    else:
        nodes = []
        extra_inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in
                        (("xq", TensorProto.UINT8, [2, 16]), ("xs", TensorProto.FLOAT, []), ("xzp", TensorProto.UINT8, []))]
    nodes += [
        helper.make_node("MatMulInteger", ["xq", "wq", "xzp", "wzp"], ["acc"], name="mmi"),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["xs", "ws"], ["scale"], name="scales"),
        helper.make_node("Mul", ["accf", "scale"], ["y"], name="rescale"),
    ]
    inputs = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])] if fed_by_dql else []) + extra_inputs
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("per_channel", [False, True])
def test_rewrite_equals_the_dequantized_weight_matmul(per_channel):
    proto = _dynamic_graph(per_channel)
    graph = gs.import_onnx(proto)
    result = DynamicQuant().run(graph, None)
    graph.cleanup().toposort()
    assert result.rewrites == 1 and not result.misses
    assert sorted(n.op for n in graph.nodes) == ["DequantizeLinear", "MatMul"]
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    got = execute.run(graph, {"x": x})["y"]
    init = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    expected = x @ ((init["wq"].astype(np.float32) - 3) * init["ws"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    before = execute.run(proto, {"x": x})["y"]  # the dynamic model: differs by the activation rounding only
    assert np.abs(got - before).max() < 0.05 * np.abs(before).max()


def test_refusal_names_why_and_the_node_stays_for_the_cpu():
    graph = gs.import_onnx(_dynamic_graph(False, fed_by_dql=False))
    result = DynamicQuant().run(graph, None)
    assert result.rewrites == 0 and result.misses[0].node == "mmi"
    assert "not made by DynamicQuantizeLinear" in result.misses[0].reason
    from mtkc.target.capability import load_table

    verdict = load_table("8.0").verdict(next(n for n in graph.nodes if n.op == "MatMulInteger"), 17)
    assert not verdict.supported and "dynamic-quant" in verdict.passes


def test_check_reports_the_quantisation_state(quantized, run_cli):
    states = {}
    for kind, path in quantized.items():
        code, stdout, err = run_cli("check", path, "--sdk", "8.0", "--seq-len", SEQ, "--format", "json")
        assert code == 0, err
        states[kind] = json.loads(stdout)["quantization"]
    assert states["float"] == {"state": "float"}
    assert states["static-tensor"]["state"] == "qdq" and states["static-tensor"]["per_channel"] == 0
    assert states["static-channel"]["per_channel"] == 15 and states["static-channel"]["weight_dtypes"] == ["int8"]
    assert states["dynamic-tensor"]["dynamic"] == {"DynamicQuantizeLinear": 9, "MatMulInteger": 15}
    code, stdout, _ = run_cli("check", quantized["static-channel"], "--sdk", "8.0", "--seq-len", SEQ)
    assert "quantized   qdq: 36 QuantizeLinear, 51 DequantizeLinear (15 per-channel; weights int8)" in stdout
    assert quantization_state(gs.import_onnx(_dynamic_graph(True)))["state"] == "dynamic"
