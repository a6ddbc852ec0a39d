"""Hypothesis campaign: mutate valid small models (delete or retype fields, swap dtypes, break
references, bend shapes) and compile them. mtkc must answer 0 (and then the graphs run: the
compile's own run check) or 2 with one line; never a traceback, never exit 4."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_kit import assert_contract, make_model, run_cli, tiny, with_cpu_node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper


def _constant_model() -> onnx.ModelProto:
    c = helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(np.ones((1, 4), np.float32)))
    return make_model([c, helper.make_node("Add", ["x", "c"], ["s"], name="add"),
                       helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1)],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])


SEEDS = [tiny, lambda: with_cpu_node("hm"), _constant_model]
DTYPES = [0, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.BOOL,
          TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.INT4, 99]
OPS = ["Relu", "MatMul", "Add", "Softmax", "Cast", "Gather", "Reshape", "Hardmax", "NoSuchOp", ""]
ATTR_TYPES = [onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT, onnx.AttributeProto.STRING,
              onnx.AttributeProto.TENSOR, onnx.AttributeProto.INTS, onnx.AttributeProto.GRAPH, 0]


def _mutate(model: onnx.ModelProto, kind: str, pick: int, value: int) -> None:
    g = model.graph
    nodes = list(g.node)
    node = nodes[pick % len(nodes)]
    if kind == "drop-node-input" and node.input:
        del node.input[pick % len(node.input)]
    elif kind == "drop-node-output" and node.output:
        del node.output[pick % len(node.output)]
    elif kind == "drop-node":
        g.node.remove(node)
    elif kind == "drop-initializer" and g.initializer:
        del g.initializer[pick % len(g.initializer)]
    elif kind == "drop-graph-input" and g.input:
        del g.input[pick % len(g.input)]
    elif kind == "drop-graph-output" and g.output:
        del g.output[pick % len(g.output)]
    elif kind == "drop-opset":
        del model.opset_import[:]
    elif kind == "drop-elem-type" and g.input:
        g.input[0].type.tensor_type.ClearField("elem_type")
    elif kind == "retype-initializer" and g.initializer:
        g.initializer[pick % len(g.initializer)].data_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-graph-input" and g.input:
        g.input[0].type.tensor_type.elem_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-graph-output" and g.output:
        g.output[0].type.tensor_type.elem_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-attribute" and node.attribute:
        node.attribute[pick % len(node.attribute)].type = ATTR_TYPES[value % len(ATTR_TYPES)]
    elif kind == "add-attribute":
        node.attribute.append(helper.make_attribute(["axis", "to", "perm", "value"][value % 4], [value, -value]))
    elif kind == "swap-op":
        node.op_type = OPS[value % len(OPS)]
    elif kind == "break-input-reference" and node.input:
        node.input[pick % len(node.input)] = f"nowhere_{value}"
    elif kind == "rename-initializer" and g.initializer:
        g.initializer[pick % len(g.initializer)].name = f"renamed_{value}"
    elif kind == "duplicate-output-name" and len(nodes) > 1 and node.output and nodes[(pick + 1) % len(nodes)].output:
        nodes[(pick + 1) % len(nodes)].output[0] = node.output[0]
    elif kind == "bend-input-shape" and g.input and g.input[0].type.tensor_type.shape.dim:
        dims = g.input[0].type.tensor_type.shape.dim
        dims[pick % len(dims)].dim_value = [0, -1, 2**40, 3, 1][value % 5]
    elif kind == "bend-initializer-dims" and g.initializer:
        t = g.initializer[pick % len(g.initializer)]
        t.dims[:] = [[], [0], [-3], [2, 2], [2**31]][value % 5]
    elif kind == "self-loop" and node.output:
        node.input.append(node.output[0])
    elif kind == "opset-version" and model.opset_import:
        model.opset_import[0].version = [1, 6, 7, 13, 18, 21, 10**6][value % 7]


KINDS = ["drop-node-input", "drop-node-output", "drop-node", "drop-initializer", "drop-graph-input",
         "drop-graph-output", "drop-opset", "drop-elem-type", "retype-initializer", "retype-graph-input",
         "retype-graph-output", "retype-attribute", "add-attribute", "swap-op", "break-input-reference",
         "rename-initializer", "duplicate-output-name", "bend-input-shape", "bend-initializer-dims", "self-loop",
         "opset-version"]
LIMIT = 120  # seconds per compile of a tiny model: a hang is a failure naming the mutations
MUTATIONS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 99)), min_size=1, max_size=3)


def _compile_mutated(seed: int, mutations) -> None:
    model = SEEDS[seed]()
    for kind, pick, value in mutations:
        if model.graph.node:
            _mutate(model, kind, pick, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        try:
            path.write_bytes(model.SerializeToString())
        except Exception:  # protobuf itself refuses to serialise it: nothing to feed mtkc
            return
        def too_slow(signum, frame):
            raise AssertionError(f"compile of a mutated model took over {LIMIT} s: {mutations}")

        previous = signal.signal(signal.SIGALRM, too_slow)
        signal.alarm(LIMIT)
        try:
            r = run_cli(["compile", path, "--sdk", "8.0", "-o", Path(tmp) / "out", "--no-convert"])
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert r.code in (0, 2), (mutations, r.err)
        assert_contract(r, r.code)
        if r.code == 2:
            assert not (Path(tmp) / "out").exists()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEEDS) - 1), MUTATIONS)
def test_mutated_models_exit_0_or_2(seed, mutations):
    _compile_mutated(seed, mutations)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEEDS) - 1), MUTATIONS)
def test_mutated_models_exit_0_or_2_long(seed, mutations):
    _compile_mutated(seed, mutations)
