"""NPU partitions are opset 17, always: an op with no opset-17 form goes to the CPU, and says why."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper


def test_gelu_from_an_opset20_model_runs_on_the_cpu_and_the_terminal_says_why(tmp_path, run_cli):
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Gelu", ["h"], ["g"], approximate="tanh"),
             helper.make_node("MatMul", ["g", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "gelu.onnx")
    code, _, err = run_cli("compile", tmp_path / "gelu.onnx", "--sdk", "8.0", "-o", tmp_path / "out", "--no-convert",
                           "--skip-pass", "gelu")  # the gelu pass would decompose it
    assert code == 0, err
    assert "mtkc: CPU: Gelu x1 (no-opset17-form: Gelu does not exist in opset 17; NPU partitions are opset 17)" in err
    targets = {}
    for path in sorted((tmp_path / "out").glob("model.*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        targets[path.name] = ([n.op_type for n in model.graph.node], [o.version for o in model.opset_import])
    assert targets == {"model.npu0.onnx": (["MatMul"], [17]), "model.cpu1.onnx": (["Gelu"], [20]),
                       "model.npu2.onnx": (["MatMul"], [17])}
    code, _, err = run_cli("verify", tmp_path / "out", "--samples", "1")
    assert code == 0, err
