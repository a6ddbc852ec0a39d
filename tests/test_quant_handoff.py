"""`mtkc convert OUT --quant`: the converter receives each NPU partition's samples and the precision."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from mtkc.pipeline.calibrate import calibrate
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.prompts import Prompt

STANDIN = Path(__file__).with_name("standin_converter.py")
QUANT_CMD = (f"{sys.executable} {STANDIN} --input {{input}} --output {{output}} --arch {{arch}} --sdk {{sdk}} "
             "--calibration {calibration} --precision {precision}")
PROMPTS = [[3, 9, 27], list(range(10, 21)), [5] * 6]


@pytest.fixture(scope="module")
def out(exported, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qhand") / "out"
    compile_model(exported("qwen2", "legacy17", True), "8.0", folder,
                  {"seq_len": 8, "cache_len": 64, "kv_cache": True, "no_convert": True})
    calibrate(folder, [Prompt(p) for p in PROMPTS], 2)
    return folder


def test_standin_receives_every_partitions_samples_and_precision(out, tmp_path, run_cli):
    work = tmp_path / "out"
    shutil.copytree(out, work)
    code, stdout, err = run_cli("convert", work, "--quant", "A16W4", "--converter-cmd", QUANT_CMD, "--format", "json")
    assert code == 0, err
    section = json.loads(stdout)
    assert section["ran"] and section["quant"]["precision_proportion"] == {"sym4W_sym16A": 1.0}
    samples = json.loads((work / "manifest.json").read_text())["calibration"]["samples"]
    for item in section["partitions"]:
        record = json.loads((work / item["output"]).read_text())
        assert "calibration-samples" in record["checks"]
        assert record["quantization"] == {"precision": "sym4W_sym16A", "samples": samples[f"{item['graph']}.{item['id']}"]}
    assert json.loads((work / "manifest.json").read_text())["converter"]["quant"]["scheme"] == "A16W4"


def test_script_carries_the_quantising_settings_when_the_sdk_is_absent(out, tmp_path, run_cli):
    work = tmp_path / "out"
    shutil.copytree(out, work)
    code, stdout, err = run_cli("convert", work, "--quant", "A16W8")
    assert code == 0, err
    assert stdout == "" and "mtkc: not converted" in err and "mtk_converter" in err and not (work / "dla").exists()
    script = (work / "convert.sh").read_text()
    for text in ("converter.quantize = True", "use_per_output_channel_quantization = True",
                 "calibration_data_gen = samples", '"$OUT"/calibration/prefill.npu0 sym8W_sym16A',
                 '"$OUT"/calibration/decode.npu0 sym8W_sym16A'):
        assert text in script


def test_missing_or_empty_calibration(out, tmp_path, run_cli):
    work = tmp_path / "out"
    shutil.copytree(out, work)
    for f in (work / "calibration" / "decode.npu0").glob("*.npz"):
        f.unlink()
    code, _, err = run_cli("convert", work, "--quant", "A8W8", "--converter-cmd", QUANT_CMD)
    assert code == 2 and "calibration/decode.npu0: no calibration samples" in err and "Traceback" not in err
    fresh = tmp_path / "fresh"
    shutil.copytree(out, fresh)
    manifest = json.loads((fresh / "manifest.json").read_text())
    del manifest["calibration"]
    (fresh / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("convert", fresh, "--quant", "A16W8", "--converter-cmd", QUANT_CMD)
    assert code == 2 and "run `mtkc calibrate" in err


def test_standin_rejects_samples_of_another_partition(out, tmp_path):
    import subprocess

    argv = [sys.executable, str(STANDIN), "--input", str(out / "decode.npu0.onnx"), "--output", str(tmp_path / "x.dla"),
            "--sdk", "8.0", "--calibration", str(out / "calibration" / "prefill.npu0"), "--precision", "sym8W_sym16A"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 1 and "has shape" in proc.stderr and not (tmp_path / "x.dla").exists()
    argv[-1] = "int8"
    argv[-3] = str(out / "calibration" / "decode.npu0")
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 1 and "unknown precision 'int8'" in proc.stderr


def test_quantising_script_feeds_the_converter_float32_samples(out, tmp_path):
    """The script convert.sh runs, against a stub `mtk_converter` that records what calibration_data_gen yields:
    float16-stored samples reach the converter cast back to the partition's float32 inputs."""
    import subprocess

    from mtkc.backend.quant_handoff import PY_QUANT

    (tmp_path / "mtk_converter.py").write_text(
        "import json\n"
        "class OnnxConverter:\n"
        "    @classmethod\n"
        "    def from_model_proto_file(cls, src, input_names, input_shapes):\n"
        "        return cls()\n"
        "    def convert_to_tflite(self, output_file, tflite_op_export_spec):\n"
        "        seen = [[(str(a.dtype), list(a.shape)) for a in sample] for sample in self.calibration_data_gen()]\n"
        "        open(output_file, 'w').write(json.dumps(seen))\n")
    manifest = json.loads((out / "manifest.json").read_text())
    part = next(p for g in manifest["graphs"] if g["name"] == "decode" for p in g["partitions"] if p["target"] == "npu")
    names = json.dumps([i["name"] for i in part["inputs"]])  # {input_names_json}: any name survives
    shapes = ":".join(",".join(map(str, i["shape"])) for i in part["inputs"])
    dst = tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-c", PY_QUANT, part["path"], str(dst), names, shapes, "calibration/decode.npu0",
                           "sym8W_sym16A", "spec"], cwd=out, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(dst.read_text())
    assert len(seen) == manifest["calibration"]["samples"]["decode.npu0"]
    assert all(s == [[i["dtype"], i["shape"]] for i in part["inputs"]] for s in seen)
