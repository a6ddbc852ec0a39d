"""Hostile inputs, round 3 (issue 22), classes crash consistency, data loss, resource abuse and
hangs, and the round-2 leftovers; with issue 24's modes, SDK spelling, usage line and --help.

Each case runs in its own folder, built by code, and asserts the exit code, the one-line stderr
naming the culprit, empty stdout on exit 2, and that no user file was deleted and nothing appeared
outside the case folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from hostile_kit import assert_contract, make_model, run_cli, save, snapshot, tiny, with_cpu_node
from onnx import TensorProto, helper

from mtkc.backend import runcheck
from mtkc.runtime.sessions import Sessions

from mtkc.pipeline.calibrate import calibrate
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.prompts import Prompt

SDK = "8.0"


def compile_args(model: Path, out: Path, *extra) -> list:
    return ["compile", model, "--sdk", SDK, "-o", out, "--no-convert", *extra]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def refused(result, says: str) -> None:
    assert_contract(result, 2, says)
    assert result.out == ""


@pytest.fixture
def case(tmp_path):
    """A case folder with a tiny model and its compiled OUT; the snapshot of everything around it."""
    model = save(tiny(), tmp_path / "m.onnx")
    out = tmp_path / "out"
    assert_contract(run_cli(compile_args(model, out)), 0)
    return model, out


@pytest.fixture(scope="module")
def kv_out(exported, tmp_path_factory):
    """A calibrated tiny Qwen2 KV-cache compile (T=8, C=32; 2 prompts, 1 decode step)."""
    folder = tmp_path_factory.mktemp("kv") / "out"
    compile_model(exported("qwen2", "legacy17", True), SDK, folder,
                  {"seq_len": 8, "cache_len": 32, "kv_cache": True, "no_convert": True})
    calibrate(folder, [Prompt([3, 4, 5]), Prompt([6, 7, 8, 9, 10])], 1)
    return folder


def kv_copy(kv_out: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(kv_out, out)
    return out


# ------------------------------------------------------------------ crash consistency


def test_killed_calibrate_staging_does_not_block_overwrite(case):
    """`kill -9` during calibrate leaves OUT/.calibration.mtkc-PID-*: the next --overwrite replaces OUT."""
    model, out = case
    stale = out / f".calibration.mtkc-{dead_pid()}-k9x1ab2c"
    (stale / "decode.npu0").mkdir(parents=True)
    (stale / "decode.npu0" / "0000.npz").write_bytes(b"half")
    assert_contract(run_cli(compile_args(model, out, "--overwrite")), 0)
    assert not stale.exists() and (out / "manifest.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx", "out"]


def test_killed_manifest_rewrite_does_not_block_overwrite(case):
    """A process killed between writing the manifest's temporary file and renaming it."""
    model, out = case
    for name in (f".manifest.json.mtkc-{dead_pid()}-tmp", ".manifest.json.mtkc-tmp"):  # this version's, the previous one's
        (out / name).write_text("{")
    assert_contract(run_cli(compile_args(model, out, "--overwrite")), 0)
    assert not [p for p in out.iterdir() if ".mtkc-" in p.name]


def test_live_staging_inside_out_is_refused(case):
    """Staging of a process that is still running is not stale: --overwrite would cut it off."""
    model, out = case
    (out / ".calibration.mtkc-1-abcdefgh").mkdir()  # pid 1 is alive
    before = snapshot(out.parent)
    refused(run_cli(compile_args(model, out, "--overwrite")), "'.calibration.mtkc-1-abcdefgh' is being written by mtkc process 1")
    assert snapshot(out.parent) == before


def test_staging_of_another_out_in_the_same_folder_is_cleaned(tmp_path):
    model = save(tiny(), tmp_path / "m.onnx")
    gone = tmp_path / f".other.mtkc-{dead_pid()}-a1b2c3d4"
    (gone / "logs").mkdir(parents=True)
    (tmp_path / f".report.md.mtkc-{dead_pid()}-tmp").write_text("half")
    live = tmp_path / ".other.mtkc-1-a1b2c3d4"
    live.mkdir()
    assert_contract(run_cli(compile_args(model, tmp_path / "out")), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "m.onnx", "out"]


# ------------------------------------------------------------------ data loss


def test_calibrate_never_deletes_a_prompts_file_inside_calibration(kv_out, tmp_path):
    out = kv_copy(kv_out, tmp_path)
    prompts = out / "calibration" / "my_prompts.jsonl"
    prompts.write_text('{"ids": [3, 4, 5]}\n')
    before = snapshot(tmp_path)
    result = run_cli(["calibrate", out, "--prompts", prompts, "--decode-steps", "1"])
    refused(result, "holds 'my_prompts.jsonl'")
    assert "calibrate only replaces the samples it wrote" in result.err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("user_file", ["logs/notes.txt", "calibration/README.md", "dla/mine.dla", "host/table.npy",
                                       "calibration/decode.npu0/extra.npz", "model.npu9.onnx"])
def test_overwrite_refuses_user_files_in_mtkc_subfolders(case, user_file):
    model, out = case
    (out / user_file).parent.mkdir(parents=True, exist_ok=True)
    (out / user_file).write_text("mine")
    before = snapshot(out.parent)
    refused(run_cli(compile_args(model, out, "--overwrite")), f"holds '{user_file}'")
    assert snapshot(out.parent) == before


def test_overwrite_replaces_what_mtkc_wrote_calibration_included(kv_out, exported, tmp_path):
    """Every file mtkc wrote (graphs, host tables, calibration samples its index lists, converter
    logs of its partitions) is replaced; the new OUT has the umask's normal modes."""
    out = kv_copy(kv_out, tmp_path)
    graph = json.loads((out / "manifest.json").read_text())["graphs"][0]
    key = f"{graph['name']}.{graph['partitions'][0]['id']}"
    (out / "logs").mkdir()
    (out / "logs" / f"{key}.log").write_text("old")
    (out / "dla").mkdir()
    (out / "dla" / f"{key}.tflite").write_bytes(b"old")
    args = compile_args(exported("qwen2", "legacy17", True), out, "--overwrite", "--seq-len", 8, "--cache-len", 32)
    assert_contract(run_cli(args), 0)
    assert not (out / "logs").exists() and not (out / "calibration").exists()
    mask = os.umask(0o022)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------ round-2 leftovers, issue 24


def test_verify_on_a_manifest_whose_partitions_were_emptied(case):
    _, out = case
    manifest = json.loads((out / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        graph["partitions"] = []
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out.parent)
    refused(run_cli(["verify", out]), "manifest.json: graph model output 'y' is made by none of its 0 partition(s)")
    assert snapshot(out.parent) == before


@pytest.mark.parametrize("value", ["nan", "1e30", "inf", "0"])
def test_generate_validates_mask_value_as_compile_does(kv_out, value):
    before = snapshot(kv_out)
    refused(run_cli(["generate", kv_out, "--prompt-ids", "3,4", "--max-new-tokens", "1", f"--mask-value={value}"]),
            "--mask-value: expected a finite negative number")
    assert snapshot(kv_out) == before


def test_generate_refuses_a_tampered_manifest_mask_value(kv_out, tmp_path):
    out = kv_copy(kv_out, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["options"]["mask_value"] = "lots"
    (out / "manifest.json").write_text(json.dumps(manifest))
    refused(run_cli(["generate", out, "--prompt-ids", "3,4", "--max-new-tokens", "1"]), "manifest.json:options:mask_value")


def test_sdk_is_spelled_once_everywhere(tmp_path):
    """`--sdk 7` is NeuroPilot 7.0: the default folder, the manifest and the table all say 7.0."""
    model = save(tiny(), tmp_path / "m.onnx")
    assert_contract(run_cli(["compile", model, "--sdk", "7", "--no-convert"], cwd=tmp_path), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mtkc-7.0", "m.onnx"]
    assert json.loads((tmp_path / "m.mtkc-7.0" / "manifest.json").read_text())["sdk"] == "7.0"


@pytest.mark.parametrize("command", ["check", "compile"])
def test_missing_sdk_is_one_line_for_check_and_compile(tmp_path, command):
    model = save(tiny(), tmp_path / "m.onnx")
    result = run_cli([command, model], cwd=tmp_path)
    refused(result, "--sdk is required (or set sdk in mtkc.toml)")
    assert result.err.count("\n") == 1 and "usage" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


# ------------------------------------------------------------------ resource abuse and hangs


def loop_model(trips: int = 10**12) -> onnx.ModelProto:
    """y = Loop(trips) { identity } over x [1,4]: 1 KB that runs for ever."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"], name="body_id"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("c_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("c_out", TensorProto.FLOAT, [1, 4])])
    return make_model([helper.make_node("Loop", ["M", "cond", "x"], ["y"], body=body, name="forever")],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                      [helper.make_tensor("M", TensorProto.INT64, [], [trips]), helper.make_tensor("cond", TensorProto.BOOL, [], [True])])


def start(args, cwd: Path, code: str | None = None) -> subprocess.Popen:
    """`mtkc ARGS` in a real process (`code`: Python run before main, e.g. to shorten a deadline)."""
    prelude = f"{code}\n" if code else ""
    script = f"import sys\n{prelude}from mtkc.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "never happened"
        time.sleep(0.05)


def staged_file(folder: Path, name: str) -> bool:
    return any((p / name).exists() for p in folder.glob(".out.mtkc-*"))


def test_a_loop_without_end_stops_at_the_run_check_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(runcheck, "RUN_SECONDS", 0.5)
    model = save(loop_model(), tmp_path / "m.onnx")
    began = time.monotonic()
    refused(run_cli(compile_args(model, tmp_path / "out")), "model.onnx: still running in onnxruntime after 0.5 s")
    assert time.monotonic() - began < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_run_check_ends_mtkc_within_a_second(tmp_path, sig):
    model = save(loop_model(), tmp_path / "m.onnx")
    proc = start(compile_args(model, tmp_path / "out"), tmp_path)
    wait_for(lambda: staged_file(tmp_path, "model.cpu0.onnx"))
    time.sleep(0.5)  # inside onnxruntime's run by now
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 2.0, err
    assert proc.returncode == 130 and err.splitlines() == ["mtkc: interrupted"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_a_session_that_never_finishes_loading_ends_at_its_deadline(tmp_path):
    """onnxruntime cannot stop a session being created: at the deadline mtkc removes the staging and
    exits 2 with one line (here the deadline is cut to 0 s, so any load outlasts it)."""
    model = save(tiny(), tmp_path / "m.onnx")
    proc = start(compile_args(model, tmp_path / "out"), tmp_path, "import mtkc.backend.runcheck as r; r.LOAD_SECONDS = 0.0")
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and stdout == "", err
    assert err.splitlines()[-1].startswith("mtkc: error: ") and "did not finish loading it within 0 s" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_check_refuses_a_range_the_shapes_announce_too_large(tmp_path):
    model = save(make_model(
        [helper.make_node("Range", ["s", "l", "d"], ["r"], name="huge_range"),
         helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("ReduceSum", ["rf"], ["red"], keepdims=0, name="sum"),
         helper.make_node("Add", ["x", "red"], ["y"], name="add")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor(n, TensorProto.INT64, [], [v]) for n, v in (("s", 0), ("l", 2**40), ("d", 1))]), tmp_path / "m.onnx")
    for command in (["check", model, "--sdk", SDK], compile_args(model, tmp_path / "out")):
        refused(run_cli(command), "node 'huge_range' (Range): 1099511627776 elements")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_the_run_check_only_loads_graphs_whose_tensors_exceed_its_bound(case, monkeypatch):
    """The sizes the shapes announce are summed before anything runs (`--seq-len 4096 --cache-len
    12288` of a tiny model: GBs); here the bound is cut to 1 byte."""
    model, out = case
    monkeypatch.setattr(runcheck, "MAX_RUN_BYTES", 1)
    real = Sessions.get
    monkeypatch.setattr(runcheck.Sessions, "get", lambda self, path: _NoRun(real(self, path)))
    result = run_cli(compile_args(model, out, "--overwrite"))
    assert_contract(result, 0)
    assert "model.onnx: its tensors hold" in result.err and "only loaded, not test-run" in result.err


class _NoRun:
    def __init__(self, sess):
        self.sess = sess

    def get_inputs(self):
        return self.sess.get_inputs()

    def run(self, *args):
        pytest.fail("the run check ran a graph past its bound")


def test_onnxruntime_errors_reach_the_terminal_only_as_mtkc_s_escaped_line(tmp_path):
    """A node that fails in onnxruntime, named to forge a line: one escaped mtkc line, no raw log."""
    name = "g\x1b]0;pwn\x07\u202e\nmtkc: wrote OUT"
    model = save(make_model(
        [helper.make_node("Gather", ["x", "i"], ["y"], axis=1, name=name)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor("i", TensorProto.INT64, [1], [10])]), tmp_path / "m.onnx")
    proc = start(compile_args(model, tmp_path / "out"), tmp_path)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and stdout == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtkc: error: ") and "does not run in onnxruntime" in lines[0], err
    assert "\x1b" not in err and "\u202e" not in err and "\\x1b]0;pwn" in err  # escaped, not raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_sigkill_of_mtkc_kills_the_converter(tmp_path):
    converter = tmp_path / "conv.py"
    converter.write_text("import os, pathlib, sys, time\npathlib.Path('conv.pid').write_text(str(os.getpid()))\ntime.sleep(300)\n")
    model = save(with_cpu_node("h"), tmp_path / "m.onnx")
    proc = start(["compile", model, "--sdk", SDK, "-o", tmp_path / "out", "--converter-cmd",
                  f"{sys.executable} {converter} {{input}} {{output}}"], tmp_path)
    wait_for(lambda: any(p.name == "conv.pid" and p.read_text() for p in tmp_path.glob(".out.mtkc-*/conv.pid")))
    pid = int(next(tmp_path.glob(".out.mtkc-*/conv.pid")).read_text())
    proc.kill()
    proc.communicate(timeout=30)
    wait_for(lambda: not _running(pid), timeout=5)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_help_imports_no_heavy_module():
    code = ("import sys\nfrom mtkc.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('numpy', 'onnx', 'onnxruntime', 'onnx_graphsurgeon', 'mtkc.commands') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "[]", proc.stdout + proc.stderr
    assert "compile" in proc.stdout and "rewrite a model for an SDK" in proc.stdout
