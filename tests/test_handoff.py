"""Converter hand-off: convert.sh, the stand-in converter, failures pinned on the right node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mtkc.backend import handoff
from mtkc.backend.manifest import graph_entry
from mtkc.backend.partition import name_nodes, partition, place
from mtkc.backend.stitch import cut
from mtkc.errors import InputError
from mtkc.ir.model import load
from mtkc.ir.weights import WeightWriter
from mtkc.target.capability import load_table

STANDIN = Path(__file__).with_name("standin_converter.py")
STANDIN_CMD = f"{sys.executable} {STANDIN} --input {{input}} --output {{output}} --arch {{arch}} --sdk {{sdk}}"
N = 32


def small_model(path: Path) -> None:
    """x -> MatMul -> Add -> Relu -> Sin -> Mul(relu, sin) -> Tanh -> MatMul -> y (Sin is not in the table)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((N, N)).astype(np.float32), n) for n in ("w1", "w2")]
    inits.append(numpy_helper.from_array(rng.standard_normal((N,)).astype(np.float32), "b"))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("Sin", ["r"], ["s"], name="sin"),
        helper.make_node("Mul", ["r", "s"], ["m"], name="mul"),
        helper.make_node("Tanh", ["m"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "w2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(onnx.shape_inference.infer_shapes(model), path)


def build_out(tmp_path: Path, sdk: str = "8.0") -> tuple[Path, dict]:
    src = tmp_path / "src"
    src.mkdir()
    small_model(src / "model.onnx")
    model = load(src / "model.onnx")
    graph = model.graph
    name_nodes(graph)
    table = load_table(sdk)
    parts, placements = partition(graph, place(graph, lambda n: table.verdict(n, graph.opset)))
    pieces = cut(graph, parts, placements, "model")
    out = tmp_path / "out"
    out.mkdir()
    with WeightWriter(out, "weights.bin") as writer:
        writer.export(graph, model.root, out / "model.onnx")
        for piece in pieces:
            writer.export(piece.graph, model.root, out / piece.entry["path"])
    manifest = {"sdk": table.version, "arch": table.arch,
                "graphs": [graph_entry("model", "model.onnx", graph, [p.entry for p in pieces])]}
    return out, manifest


def test_partitions_of_the_small_model(tmp_path):
    out, manifest = build_out(tmp_path)
    parts = manifest["graphs"][0]["partitions"]
    assert [(p["id"], p["nodes"]) for p in parts] == [
        ("npu0", ["mm1", "add", "relu"]), ("cpu1", ["sin"]), ("npu2", ["mul", "tanh", "mm2"])]
    assert parts[1]["cpu_reasons"]["sin"].startswith("op-unsupported: SIN")
    assert parts[2]["inputs"] == [{"name": "r", "dtype": "float32", "shape": [1, N], "from": "npu0"},
                                  {"name": "s", "dtype": "float32", "shape": [1, N], "from": "cpu1"}]
    assert (out / "weights.bin").stat().st_size >= 2 * N * N * 4  # w1, w2 external, stored once


def test_no_converter_writes_script_and_says_so(tmp_path, monkeypatch):
    out, manifest = build_out(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = handoff.run(out, manifest, load_table("8.0").converter)
    assert result.error is None
    assert result.section["ran"] is False and "ncc-tflite not found" in result.section["reason"]
    script = (out / "convert.sh").read_text()
    assert ('mtk_onnx_converter --input_model_file "$OUT"/model.npu0.onnx --output_file "$OUT"/dla/model.npu0.tflite'
            in script)
    assert "ncc-tflite --arch=mdla5.3 --relax-fp32 -O3" in script and "model.cpu1" not in script
    assert not (out / "logs").exists()


def test_no_convert_flag_with_standin_script_runs_by_hand(tmp_path):
    out, manifest = build_out(tmp_path)
    result = handoff.run(out, manifest, converter_cmd=STANDIN_CMD, no_convert=True)
    assert result.section["ran"] is False and result.section["reason"].startswith("--no-convert")
    assert not (out / "dla").exists()
    proc = subprocess.run(["sh", str(out / "convert.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "dla" / "model.npu2.dla").read_text())
    assert "NOT a DLA" in record["standin"] and record["ops"] == {"MatMul": 1, "Mul": 1, "Tanh": 1}


def test_standin_converts_every_npu_partition(tmp_path):
    out, manifest = build_out(tmp_path)
    result = handoff.run(out, manifest, converter_cmd=STANDIN_CMD)
    assert result.error is None, result.error
    assert result.section["ran"] is True
    assert [(p["id"], p["exit_code"], p["output"]) for p in result.section["partitions"]] == [
        ("npu0", 0, "dla/model.npu0.dla"), ("npu2", 0, "dla/model.npu2.dla")]
    assert "standin-converter: ok, 3 nodes checked" in (out / "logs" / "model.npu0.log").read_text()


@pytest.mark.parametrize("extra, method, nodes", [
    ("--reject-op Tanh", "log-node", ["tanh"]),
    ("--reject-op Tanh --style terse", "log-op", ["tanh"]),
    ("--reject-node mm2 --style opaque", "bisect", ["mm2"]),
    ("--reject-node mul --style opaque", "bisect", ["mul"]),
])
def test_injected_failure_is_pinned_on_the_node(tmp_path, extra, method, nodes):
    out, manifest = build_out(tmp_path)
    result = handoff.run(out, manifest, converter_cmd=f"{STANDIN_CMD} {extra}")
    assert result.section["partitions"][0]["exit_code"] == 0
    failed = result.section["partitions"][1]
    assert failed["id"] == "npu2" and failed["exit_code"] == 1
    assert failed["blame"]["method"] == method and failed["blame"]["nodes"] == nodes
    message = str(result.error)
    assert result.error.exit_code == 3
    assert f"partition model/npu2 (exit 1) at node '{nodes[0]}'" in message and "logs/model.npu2.log" in message
    if method == "bisect":
        assert failed["blame"]["runs"] <= 2
        assert not list(out.glob(".bisect*")) and not list((out / "dla").glob("*bisect*"))


def test_bad_templates_are_input_errors(tmp_path):
    with pytest.raises(InputError, match=r"unknown placeholder \{model\}"):
        handoff.command_backend("conv {model} {output}")
    with pytest.raises(InputError, match="empty command"):
        handoff.command_backend("  ")


def test_missing_converter_program_fails_with_exit_3(tmp_path):
    out, manifest = build_out(tmp_path)
    result = handoff.run(out, manifest, converter_cmd=f"{tmp_path}/no-such-tool {{input}}")
    assert result.section["ran"] is False and "not found" in result.section["reason"]


# ---------------------------------------------------------------------------- through mtkc compile

PASSES = ["bind-shapes", "fold", "cleanup", "mask", "rope", "rmsnorm", "swiglu", "attention"]


def test_compile_cli_standin_sees_legal_partitions_and_failure_exits_3(exported, run_cli, tmp_path):
    """Every NPU partition passes the stand-in's contract checks except those holding the injected
    failure (Softmax); the error names the first of them and its node. Transposes are forced to
    the CPU so the graph has several NPU partitions whatever the table supports."""
    model = exported("qwen2", "legacy17")
    out = tmp_path / "out"
    code, _, err = run_cli("compile", model, "--sdk", "8.0", "--seq-len", "8", "--passes", ",".join(PASSES), "-o", out,
                           "--force-cpu", "op:Transpose", "--converter-cmd", f"{STANDIN_CMD} --reject-op Softmax")
    assert code == 3, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["path"] == str(model.resolve()) and manifest["converter"]["ran"]
    results = manifest["converter"]["partitions"]
    npu = [p for p in manifest["graphs"][0]["partitions"] if p["target"] == "npu"]
    assert [r["id"] for r in results] == [p["id"] for p in npu] and len(npu) > 4
    with_softmax = {p["id"]: {n for n in p["nodes"] if n.endswith("Softmax")} for p in npu}
    with_softmax = {k: v for k, v in with_softmax.items() if v}
    failed = [r for r in results if r["exit_code"]]
    assert [r["id"] for r in failed] == list(with_softmax) and len(failed) == 2
    assert all(r["blame"]["method"] == "log-node" and set(r["blame"]["nodes"]) == with_softmax[r["id"]] for r in failed)
    assert all(r["exit_code"] == 0 and (out / r["output"]).is_file() for r in results if r not in failed)
    first = failed[0]
    assert f"converter failed on partition model/{first['id']} (exit 1) at node '{first['blame']['nodes'][0]}'" in err
    assert "1 more partition(s) failed" in err and (out / first["log"]).is_file()
    assert f"{len(npu) - 2} converted, 2 failed." in (out / "report.md").read_text()


def test_unsupported_and_forced_nodes_land_on_cpu_with_their_reason(tmp_path):
    from mtkc.pipeline.compile import compile_model

    src = tmp_path / "src"
    src.mkdir()
    small_model(src / "model.onnx")
    out = tmp_path / "out"
    compile_model(src / "model.onnx", "8.0", out, {"passes": ["fold"], "force_cpu": ["node:tanh"], "no_convert": True})
    report = json.loads((out / "report.json").read_text())
    cpu = {c["node"]: (c["reason"], c["partition"]) for c in report["placement"]["model"]["cpu"]}
    assert cpu == {"sin": ("op-unsupported", "cpu1"), "tanh": ("forced-cpu", "cpu3")}
    overlay = json.loads((out / "model.placement.json").read_text())
    assert overlay["results"]["sin"] == {"value": "CPU: op-unsupported", "bgColor": "#c62828"}
    assert overlay["results"]["mm1"] == {"value": "NPU", "bgColor": "#2e7d32"}
    assert set(overlay["results"]) == {"mm1", "add", "relu", "sin", "mul", "tanh", "mm2"}
    text = (out / "report.md").read_text()
    assert "| `sin` | Sin | cpu1 | op-unsupported |" in text and "| `tanh` | Tanh | cpu3 | forced-cpu | --force-cpu node:tanh |" in text
    assert "Not run: --no-convert" in text
    with pytest.raises(InputError, match=r"--force-npu node:sin: node 'sin' \(Sin\) is not supported on the NPU: op-unsupported"):
        compile_model(src / "model.onnx", "8.0", tmp_path / "out2", {"passes": ["fold"], "force_npu": ["node:sin"]})
    assert not (tmp_path / "out2").exists()


def test_two_compiles_are_byte_identical(exported, tmp_path, monkeypatch):
    from mtkc.pipeline.compile import compile_model

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no converter on PATH: convert.sh only
    outs = [tmp_path / name for name in ("a", "b")]
    for out in outs:
        compile_model(exported("qwen2", "legacy17"), "8.0", out, {"seq_len": 8, "passes": PASSES})
    files = sorted(p.relative_to(outs[0]).as_posix() for p in outs[0].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs[1]).as_posix() for p in outs[1].rglob("*") if p.is_file())
    assert {"convert.sh", "report.md", "model.placement.json", "weights.bin"} <= set(files)
    assert any(f.startswith("model.npu") for f in files)

    def content(path: Path) -> bytes:
        if path.name != "report.json":
            return path.read_bytes()
        report = json.loads(path.read_text())
        for record in report["passes"]:
            record.pop("seconds", None)  # wall-clock timings: diagnostic only
        return json.dumps(report, sort_keys=True).encode()

    assert [f for f in files if content(outs[0] / f) != content(outs[1] / f)] == []


def test_placeholders_fill_names_and_shapes():
    job = handoff.Job("prefill", "npu3", "prefill.npu3.onnx", ["hidden_states", "attention_mask"],
                      [[1, 128, 640], [1, 1, 128, 640]])
    values = job.values()  # relative to OUT, where the converter runs
    assert values["input"] == "prefill.npu3.onnx" and values["output"] == "dla/prefill.npu3.dla"
    assert values["input_names"] == "hidden_states,attention_mask"
    assert values["input_shapes"] == "1,128,640:1,1,128,640"
    backend = handoff.command_backend("conv --shapes={input_shapes} '{input}' -o {output}")
    assert backend.steps == [["conv", "--shapes={input_shapes}", "{input}", "-o", "{output}"]]


def test_mediatek_chain_runs_both_steps_when_installed(tmp_path, monkeypatch):
    """Fake mtk_onnx_converter / ncc-tflite on PATH: the table's two commands run per partition."""
    out, manifest = build_out(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = {  # each writes the file named after its output flag, and echoes its argv
        "mtk_onnx_converter": "import sys; a = sys.argv; open(a[a.index('--output_file') + 1], 'w').write('tflite')",
        "ncc-tflite": "import sys; a = sys.argv; open(a[a.index('-o') + 1], 'w').write('dla')",
    }
    for name, code in fake.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n{code}\nprint(' '.join(sys.argv[1:]))\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(handoff.importlib.util, "find_spec", lambda name: None)  # no mtk_converter wheel
    result = handoff.run(out, manifest, load_table("8.0").converter)
    assert result.error is None and result.section["backend"] == "mediatek-cli" and result.section["ran"]
    assert (out / "dla" / "model.npu2.tflite").read_text() == "tflite"
    assert (out / "dla" / "model.npu2.dla").read_text() == "dla"
    log = (out / "logs" / "model.npu2.log").read_text()
    assert "--tflite_op_export_spec npsdk_v8" in log and "--arch=mdla5.3 --relax-fp32 -O3" in log


def test_mediatek_python_api_preferred_when_importable(tmp_path, monkeypatch):
    out, manifest = build_out(tmp_path)
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "mtk_converter.py").write_text(
        "import json\n"
        "class OnnxConverter:\n"
        "    @classmethod\n"
        "    def from_model_proto_file(cls, path, input_names=None, input_shapes=None):\n"
        "        c = cls(); c.args = [path.rsplit('/', 1)[-1], input_names, input_shapes]; return c\n"
        "    def convert_to_tflite(self, output_file, tflite_op_export_spec):\n"
        "        open(output_file, 'w').write(json.dumps(self.args + [tflite_op_export_spec]))\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ncc-tflite").write_text(f"#!{sys.executable}\nimport sys; a = sys.argv; open(a[a.index('-o') + 1], 'w').write('dla')\n")
    (bin_dir / "ncc-tflite").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    monkeypatch.syspath_prepend(str(pkg))
    result = handoff.run(out, manifest, load_table("8.0").converter)
    assert result.error is None and result.section["backend"] == "mediatek-python"
    assert json.loads((out / "dla" / "model.npu2.tflite").read_text()) == [
        "model.npu2.onnx", ["r", "s"], [[1, N], [1, N]], "npsdk_v8"]


def test_cli_partition_options(tmp_path, run_cli):
    src = tmp_path / "src"
    src.mkdir()
    small_model(src / "model.onnx")
    code, _, err = run_cli("compile", src / "model.onnx", "--sdk", "8.0", "-o", tmp_path / "a", "--force-cpu", "Tanh")
    assert code == 2 and "--force-cpu 'Tanh': expected op:TYPE or node:GLOB" in err and not (tmp_path / "a").exists()
    code, _, err = run_cli("compile", src / "model.onnx", "--sdk", "8.0", "-o", tmp_path / "b", "--passes", "fold",
                           "--min-partition-nodes", "4", "--no-convert")
    assert code == 0, err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [p["target"] for p in manifest["graphs"][0]["partitions"]] == ["cpu"]
    assert manifest["options"]["min_partition_nodes"] == 4 and manifest["coverage"]["placed"] == 0.0
    assert manifest["converter"] == {**manifest["converter"], "ran": False, "reason": "no NPU partition to convert"}


def test_blame_prefers_error_lines_over_a_verbose_listing(tmp_path):
    out, manifest = build_out(tmp_path)
    job = handoff.jobs(manifest)[1]
    log = "$ conv --input x\nvisiting mul\nvisiting tanh\nvisiting mm2\nE: unsupported operation at tanh\nexit code: 1\n"
    assert handoff.blame(out, job, log, fails=None) == {"method": "log-node", "nodes": ["tanh"], "ops": ["Tanh"]}
    log = "visiting mul\nconversion aborted\n"  # no error line names anything: the whole log is searched
    assert handoff.blame(out, job, log, fails=None)["nodes"] == ["mul"]
