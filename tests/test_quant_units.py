"""Quantisation units by structure (issue 18): "layer i" of `--keep-fp`, plans and the per-layer rows is
the compile's record (`graphs[].decoder`, `mtkc.analysis.regions`), the layer reading `past_key_i`,
whatever the nodes are called. The exporter's `layers.<i>/` scopes of a TorchScript export are the
independent oracle; the same export with every node and tensor renamed must give the same units."""

from __future__ import annotations

import copy
import json
import re
import shutil

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantType

from mtkc.pipeline.calibrate import calibrate
from mtkc.pipeline.compile import compile_model
from mtkc.pipeline.quantplan import LM_HEAD, Precision, Units
from mtkc.pipeline.quantsim import overrides
from mtkc.runtime.prompts import Prompt

T, C = 8, 64
SCOPE = re.compile(r"layers\.(\d+)/")


def _renamed(source, path):
    """The export with node i called `n<i>` and every inner tensor `t<k>` (graph I/O and weights keep
    theirs): nothing of the exporter's scopes is left. Returns {new node name: old name}."""
    model = onnx.load(str(source))
    g = model.graph
    keep = {t.name for t in (*g.input, *g.output)} | {t.name for t in g.initializer}
    tensors = {}
    for node in g.node:
        for name in node.output:
            if name and name not in keep:
                tensors.setdefault(name, f"t{len(tensors)}")
    names = {}
    for k, node in enumerate(g.node):
        names[f"n{k}"], node.name = node.name, f"n{k}"
        node.input[:] = [tensors.get(x, x) for x in node.input]
        node.output[:] = [tensors.get(x, x) for x in node.output]
    for info in g.value_info:
        info.name = tensors.get(info.name, info.name)
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin")
    return names


def _compile(path, out):
    compile_model(path, "8.0", out, {"seq_len": T, "cache_len": C, "kv_cache": True, "mask_value": -100.0})
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def both(exported, tmp_path_factory):
    root = tmp_path_factory.mktemp("units")
    source = exported("qwen2", "legacy17", True)
    (root / "renamed").mkdir()
    names = _renamed(source, root / "renamed" / "model.onnx")
    return (root / "named", _compile(source, root / "named")), (root / "bare", _compile(root / "renamed" / "model.onnx",
                                                                                          root / "bare")), names


def _units(out, manifest) -> dict[str, dict[str, object]]:
    return Units(out, manifest).nodes


def test_units_are_the_exporters_layers_and_survive_renaming(both):
    (named_out, named), (bare_out, bare), names = both
    by_scope = _units(named_out, named)
    for graph in named["graphs"]:
        units, nodes = by_scope[graph["name"]], [n for p in graph["partitions"] for n in p["nodes"]]
        scoped = {n: int(SCOPE.search(n)[1]) for n in nodes if SCOPE.search(n)}
        assert set(units.values()) == {0, 1, LM_HEAD} and units[next(n for n in nodes if "lm_head" in n)] == LM_HEAD
        differ = {n for n in scoped if units.get(n) != scoped[n]}
        # TorchScript shares layer 0's unsqueeze of the RoPE tables with layer 1: in no layer by structure
        assert len(differ) == 2 and all(units.get(n) is None and "Unsqueeze" in n for n in differ), differ
        assert {n for n, u in units.items() if u != LM_HEAD} <= set(scoped)
    back = lambda name: names[name.split("/")[0]] + name[len(name.split("/")[0]):]  # noqa: E731 (pass-made suffixes)
    for graph, units in _units(bare_out, bare).items():
        assert {back(n): u for n, u in units.items()} == by_scope[graph]


def test_keep_fp_1_raises_exactly_the_layer_reading_past_key_1(both, tmp_path):
    """`--keep-fp 1` on the renamed export: the weights at 16 bits are the MatMuls of the layer whose
    cache Concat reads past_key_1 (and which the exporter called layers.1), the rest at 8 bits."""
    _, (out, manifest), names = both
    record = Units(out, manifest)
    graph = next(g for g in manifest["graphs"] if g["name"] == "prefill")
    part = next(p for p in graph["partitions"] if p["target"] == "npu")
    proto = onnx.load(str(out / part["path"]), load_external_data=False).graph
    reads_past = {n.name for n in proto.node if "past_key_1" in n.input}
    assert reads_past and {record.of("prefill", n) for n in reads_past} == {1}
    found = overrides(proto, Precision.keep("A16W8", [1]), lambda t, axis: np.ones(t.dims[axis], np.float32),
                      lambda node: record.of("prefill", node.name))
    bits = {}
    for node in proto.node:
        if node.op_type in ("MatMul", "Gemm") and node.input[1] in found:
            bits[names[node.name.split("/")[0]]] = found[node.input[1]][0]["quant_type"]
    raised = {n for n, q in bits.items() if q == QuantType.QInt16}
    assert raised and raised == {n for n in bits if "layers.1/" in n}
    assert all(q == QuantType.QInt8 for n, q in bits.items() if n not in raised)


def test_an_out_without_the_record_asks_for_a_recompile(both, tmp_path, run_cli):
    (out, manifest), _, _ = both
    manifest = copy.deepcopy(manifest)
    del manifest["graphs"][0]["decoder"]
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / "manifest.json").write_text(json.dumps(manifest))
    calibrate(old, [Prompt([5, 6, 7])], 1)
    code, stdout, err = run_cli("verify", old, "--quant", "A16W8", "--keep-fp", "1")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert "graphs[0].decoder: missing" in err and "compile the model again" in err, err


def _ops_by_unit(out, manifest) -> dict:
    """{graph: {unit: sorted op types}}."""
    found = {}
    for graph in manifest["graphs"]:
        ops = {n.name: n.op_type for n in onnx.load(str(out / graph["path"]), load_external_data=False).graph.node}
        units = Units(out, manifest).nodes[graph["name"]]
        found[graph["name"]] = {u: sorted(ops[n] for n, v in units.items() if v == u) for u in set(units.values())}
    return found


def test_a_dynamo_export_has_the_torchscript_exports_units(both, exported, tmp_path):
    """torch.onnx.export(dynamo=True) names nodes `node_MatMul_266`: no `layers.<i>/` to read, the same
    layers by structure (op for op) as the TorchScript export of the same model."""
    (named_out, named), _, _ = both
    dynamo = _compile(exported("qwen2", "dynamo", True), tmp_path / "dynamo")
    assert not any(SCOPE.search(n) for g in dynamo["graphs"] for p in g["partitions"] for n in p["nodes"])
    assert _ops_by_unit(tmp_path / "dynamo", dynamo) == _ops_by_unit(named_out, named)
