"""contrib-ops: com.microsoft FusedMatMul -> MatMul (+ Transpose, + Mul(alpha)), same numbers in onnxruntime.

Synthetic graphs cover every transpose combination onnxruntime accepts and the refusals; the
ortfused tiny exports (tied lm_head as FusedMatMul(x, W, transB=1)) compile to 100 % NPU on SDK 8.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from mtkc.ir.execute import run
from mtkc.ir.model import load
from mtkc.passes.contrib import ContribOps, permutation
from mtkc.rewrite.pass_api import Context
from mtkc.target.capability import load_table


def _fused(shape_a, shape_b, known_rank=True, **attrs):
    """One FusedMatMul(A, B) graph whose operands are stored so that op(A) @ op(B) is defined."""
    node = oh.make_node("FusedMatMul", ["A", "B"], ["Y"], domain="com.microsoft", name="fmm", **attrs)
    info = [oh.make_tensor_value_info(n, TP.FLOAT, s if known_rank else None) for n, s in (("A", shape_a), ("B", shape_b))]
    proto = oh.make_model(oh.make_graph([node], "g", info, [oh.make_tensor_value_info("Y", TP.FLOAT, None)]),
                          opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    return gs.import_onnx(proto)


def _stored(logical, trans, batch):
    """The stored shape whose FusedMatMul view (trans/transBatch) is `logical`."""
    perm = permutation(len(logical), trans, batch)
    return [logical[i] for i in np.argsort(perm)]


def _ctx(sdk="8.0"):
    return Context(load_table(sdk) if sdk else None, {})


def _ops(graph):
    return sorted(n.op for n in graph.cleanup().nodes)


CASES = [(ta, tb, ba, bb) for ta, tb, ba, bb in itertools.product((0, 1), repeat=4)]


@pytest.mark.parametrize("trans_a,trans_b,batch_a,batch_b", CASES)
def test_fused_matmul_matches_onnxruntime(trans_a, trans_b, batch_a, batch_b):
    a, b = _stored([2, 3, 5, 6], trans_a, batch_a), _stored([2, 3, 6, 4], trans_b, batch_b)
    before = _fused(a, b, transA=trans_a, transB=trans_b, transBatchA=batch_a, transBatchB=batch_b, alpha=0.25)
    graph = _fused(a, b, transA=trans_a, transB=trans_b, transBatchA=batch_a, transBatchB=batch_b, alpha=0.25)
    result = ContribOps().run(graph, _ctx())
    assert (result.rewrites, result.misses) == (1, [])
    transposes = (trans_a or batch_a) + (trans_b or batch_b)
    assert _ops(graph) == sorted(["MatMul", "Mul"] + ["Transpose"] * transposes)
    rng = np.random.default_rng(0)
    feeds = {"A": rng.standard_normal(a).astype(np.float32), "B": rng.standard_normal(b).astype(np.float32)}
    want = run(before, feeds)["Y"]
    assert want.shape == (2, 3, 5, 4)
    np.testing.assert_allclose(run(graph, feeds)["Y"], want, atol=1e-5, rtol=0)


def test_lm_head_form_is_one_matmul_over_a_transposed_weight():
    graph = _fused([1, 3, 8], [16, 8], transB=1)
    graph.nodes[0].inputs[1] = gs.Constant("W", np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32))
    graph.inputs.pop()
    assert ContribOps().run(graph, _ctx()).rewrites == 1
    (transpose, matmul) = sorted(graph.cleanup().nodes, key=lambda n: n.op, reverse=True)
    assert (transpose.op, transpose.attrs["perm"], transpose.inputs[0].name) == ("Transpose", [1, 0], "W")
    assert matmul.op == "MatMul" and matmul.outputs[0].name == "Y" and list(transpose.outputs[0].shape) == [8, 16]


@pytest.mark.parametrize("shapes,known,attrs,reason", [
    (([3, 5, 6], [6, 4]), True, {"transBatchA": 1}, "transBatch needs A and B of one rank >= 3 (ranks 3, 2)"),
    (([5, 6], [4, 6]), False, {"transB": 1}, "transB on operand B of unknown rank"),
])
def test_refusals_name_the_reason(shapes, known, attrs, reason):
    graph = _fused(*shapes, known_rank=known, **attrs)
    result = ContribOps().run(graph, _ctx())
    assert result.rewrites == 0 and [(m.node, m.reason) for m in result.misses] == [("fmm", reason)]
    assert _ops(graph) == ["FusedMatMul"]


def test_plain_fused_matmul_without_a_table_needs_no_rank():
    graph = _fused([5, 6], [6, 4], known_rank=False)
    assert ContribOps().run(graph, _ctx(None)).rewrites == 1 and _ops(graph) == ["MatMul"]


def test_an_op_the_table_supports_is_left_alone():
    class Native:
        version = "test"

        def has_op(self, domain, op_type):
            return (domain, op_type) == ("com.microsoft", "FusedMatMul")

    graph = _fused([5, 6], [4, 6], transB=1)
    result = ContribOps().run(graph, Context(Native(), {}))
    assert (result.rewrites, result.misses, _ops(graph)) == (0, [], ["FusedMatMul"])


@pytest.mark.parametrize("exporter", ["hf-ortfused", "dynamo-ortfused"])
def test_ortfused_exports_keep_their_logits(exported, exporter):
    model = load(exported("qwen2", exporter, False))
    graph = gs.import_onnx(gs.export_onnx(model.graph, do_type_check=False))
    result = ContribOps().run(graph, Context(load_table("8.0"), {}, model.root, model.values))
    assert (result.rewrites, result.misses) == (1, [])
    ops, original = _ops(graph), _ops(model.graph)
    assert "FusedMatMul" not in ops and ops.count("MatMul") == original.count("MatMul") + 1
    assert ops.count("Transpose") == original.count("Transpose") + 1  # of the tied embedding table
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(3, 1000, (1, 5)), "attention_mask": np.ones((1, 5), np.int64),
             "position_ids": np.arange(5)[None]}
    feeds = {t.name: feeds[t.name] for t in model.graph.inputs}
    want, got = run(model.graph, feeds, model.root)["logits"], run(graph, feeds, model.root)["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_compile_reaches_full_npu_coverage_and_verifies(exported, run_cli, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli("compile", exported("qwen2", "hf-ortfused", False), "--sdk", "8.0", "--seq-len", "8",
                           "-o", out, "--no-convert")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["coverage"]["compiled"] == 1.0
    assert [p["rewrites"] for p in manifest["passes"] if p["name"] == "contrib-ops"] == [1]
    code, stdout, err = run_cli("verify", out)
    assert code == 0 and stdout.rstrip().endswith("min cosine 0.999)"), stdout + err
