"""verify: stitched partitions and whole graphs against the original model, on tiny exports."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from mtkc import verify as V
from mtkc.errors import InputError
from mtkc.execute import run
from mtkc.model import load
from mtkc.partition import name_nodes, partition, place
from mtkc.manifest import tensor_spec
from mtkc.stitch import cut

SEQ = 8


def annotate(graph: gs.Graph, feeds: dict) -> None:
    """Give every tensor its concrete dtype/shape by running the graph once (test harness only)."""
    probe = graph.copy()
    tensors = [t for t in probe.tensors().values() if isinstance(t, gs.Variable) and t.inputs]
    probe.outputs = tensors
    values = run(probe, feeds)
    for name, tensor in graph.tensors().items():
        if name in values:
            tensor.dtype, tensor.shape = values[name].dtype, list(values[name].shape)


def toy_compile(model_path: Path, out: Path, cpu_ops=("Sin", "Cos", "Range")) -> dict:
    """A stand-in for compile: bind [1,SEQ], place by op type, stitch, write the manifest."""
    model = load(model_path)
    graph = model.graph
    for t in graph.inputs:
        t.shape = [1, SEQ]
    feeds = {"input_ids": np.arange(SEQ, dtype=np.int64)[None] + 3, "attention_mask": np.ones((1, SEQ), np.int64)}
    annotate(graph, feeds)
    name_nodes(graph)
    verdict = lambda n: SimpleNamespace(supported=n.op not in cpu_ops, reason="op-not-in-table", detail=n.op)  # noqa: E731
    parts, placements = partition(graph, place(graph, verdict))
    out.mkdir(parents=True, exist_ok=True)

    pieces = cut(graph, parts, placements, "model")
    for piece in pieces:
        onnx.save(gs.export_onnx(piece.graph), out / piece.entry["path"])
    onnx.save(gs.export_onnx(graph), out / "model.onnx")
    entries = [p.entry for p in pieces]
    manifest = {
        "schema_version": 1,
        "model": {"path": str(model_path.resolve())},
        "graphs": [{"name": "model", "path": "model.onnx", "inputs": [tensor_spec(t) for t in graph.inputs],
                    "outputs": [tensor_spec(t) for t in graph.outputs], "partitions": entries}],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "out"
    manifest = toy_compile(exported("qwen2", "legacy17"), out)
    return out, manifest


def test_toy_compile_has_npu_and_cpu_partitions(compiled):
    _, manifest = compiled
    parts = manifest["graphs"][0]["partitions"]
    assert {p["target"] for p in parts} == {"npu", "cpu"}
    assert all(p["path"].startswith("model.") for p in parts)
    cpu_ops = {r for p in parts if p["target"] == "cpu" for r in p["cpu_reasons"].values()}
    assert cpu_ops <= {"op-not-in-table: Sin", "op-not-in-table: Cos", "op-not-in-table: Range"}
    for p in parts:
        for i in p["inputs"]:
            assert i["from"] == "graph" or i["from"] in [q["id"] for q in parts]


def test_verify_passes_on_tiny_export(compiled):
    out, _ = compiled
    result = V.verify(out, samples=2)
    assert result.ok, V.format_text(result)
    assert {(c.pipeline, c.output) for c in result.checks} == {("partitions", "logits"), ("graph", "logits")}
    assert all(c.cosine > 0.99999 and c.max_abs < 1e-4 for c in result.checks)


def test_verify_cli_fails_naming_the_output_on_corrupted_partition(compiled, run_cli, tmp_path):
    import shutil

    src, manifest = compiled
    out = tmp_path / "out"
    shutil.copytree(src, out)
    part = next(p for p in manifest["graphs"][0]["partitions"] if p["target"] == "npu" and
                any(o["dtype"] == "float32" for o in p["outputs"]))
    proto = onnx.load(out / part["path"])
    target = next(o for o in proto.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT)
    inner = target.name + "_corrupt_src"
    for node in proto.graph.node:  # rename the producer's output, then scale it by 1.5 into the old name
        node.output[:] = [inner if o == target.name else o for o in node.output]
        node.input[:] = [inner if i == target.name else i for i in node.input]
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.5, np.float32), "corrupt_scale"))
    proto.graph.node.append(onnx.helper.make_node("Mul", [inner, "corrupt_scale"], [target.name], name="corrupt"))
    onnx.save(proto, out / part["path"])
    code, stdout, stderr = run_cli("verify", out, "--samples", "1")
    assert code == 1, stderr
    assert "mtkc: error:" in stderr and "'logits'" in stderr and "partitions" in stderr
    assert "MISMATCH" in stdout
    code, stdout, _ = run_cli("verify", out, "--samples", "1", "--format", "json")
    report = json.loads(stdout)
    assert code == 1 and not report["ok"]
    assert {(c["pipeline"], c["ok"]) for c in report["checks"]} == {("partitions", False), ("graph", True)}


def test_verify_missing_manifest_is_input_error(tmp_path, run_cli):
    code, _, stderr = run_cli("verify", tmp_path)
    assert code == 2 and "no manifest" in stderr


def test_causal_mask_and_feeds_mapping():
    mask = V.causal_mask(2, 5, np.float32)
    assert mask.shape == (1, 1, 2, 5)
    assert (mask[0, 0] == 0).tolist() == [[True, True, True, True, False], [True] * 5]
    args = [SimpleNamespace(name="input_ids", type="tensor(int64)", shape=["batch_size", "sequence_length"]),
            SimpleNamespace(name="attention_mask", type="tensor(int64)", shape=["batch_size", "total_sequence_length"]),
            SimpleNamespace(name="position_ids", type="tensor(int64)", shape=["batch_size", "sequence_length"]),
            SimpleNamespace(name="past_key_values.0.key", type="tensor(float)", shape=["batch_size", 2, "p", 16])]
    compiled = [{"name": "input_ids", "dtype": "int32", "shape": [1, 2]},
                {"name": "attention_mask", "dtype": "float32", "shape": [1, 1, 2, 5]},
                {"name": "position_ids", "dtype": "int32", "shape": [1, 2]},
                {"name": "past_key_0", "dtype": "float32", "shape": [1, 2, 3, 16]}]
    original, feeds = V.build_feeds(args, compiled, vocab=50, seed=0)
    assert original["attention_mask"].shape == (1, 5) and original["position_ids"].tolist() == [[3, 4]]
    assert feeds["input_ids"].dtype == np.int32 and (feeds["input_ids"] == original["input_ids"]).all()
    assert (feeds["past_key_0"] == original["past_key_values.0.key"]).all()
    assert V.match_output("present_key_0", ["logits", "present.0.key"]) == "present.0.key"
    with pytest.raises(InputError, match="compiled input 'pos_emb'"):
        V.build_feeds(args, compiled + [{"name": "pos_emb", "dtype": "float32", "shape": [1, 2, 2, 16]}], 50, 0)
