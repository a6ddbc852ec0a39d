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
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_kit import assert_contract, run_cli, save, snapshot, tiny

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
