"""OUT is written atomically (complete, or the previous OUT intact) and deterministically."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtkc.cli import main
from mtkc.errors import ConverterError, InputError
from mtkc.pipeline.compile import compile_model

STANDIN = Path(__file__).with_name("standin_converter.py")
STANDIN_CMD = f"{sys.executable} {STANDIN} --input {{input}} --output {{output}} --arch {{arch}}"
PASSES = ["bind-shapes", "fold", "cleanup", "mask", "rope", "rmsnorm", "swiglu", "attention"]


def files(folder: Path) -> dict[str, bytes]:
    """Every file by relative path; report.json without its per-pass wall-clock `seconds` (the only
    bytes that differ between two identical compiles)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "report.json":
                report = json.loads(data)
                for record in report["passes"]:
                    assert record.pop("seconds") >= 0
                data = json.dumps(report, sort_keys=True).encode()
            found[path.relative_to(folder).as_posix()] = data
    return found


@pytest.fixture
def previous(exported, tmp_path):
    """A compiled OUT (qwen2, passes=fold) and its files."""
    out = tmp_path / "out"
    compile_model(exported("qwen2", "legacy17"), "8.0", out, {"passes": ["fold"], "no_convert": True})
    return out, files(out)


NEW = {"seq_len": 8, "passes": PASSES, "overwrite": True, "no_convert": True}


@pytest.mark.parametrize("where", ["mtkc.backend.report.overlay", "mtkc.backend.report.markdown", "mtkc.backend.handoff._write_script"])
def test_a_failure_while_writing_reports_keeps_the_previous_output(exported, previous, tmp_path, monkeypatch, where):
    out, before = previous

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(where, fail)
    with pytest.raises(InputError, match="No space left"):  # the user's disk: exit 2, not a crash
        compile_model(exported("qwen2", "legacy17"), "8.0", out, NEW)
    assert files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind


@pytest.mark.parametrize("where", ["mtkc.backend.report.markdown", "mtkc.backend.handoff._execute"])
def test_ctrl_c_keeps_the_previous_output_and_exits_130(exported, previous, tmp_path, monkeypatch, capsys, where):
    """Ctrl-C while writing the report, or while the converter runs (inside the staging folder)."""
    out, before = previous

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(where, interrupt)
    code = main(["compile", str(exported("qwen2", "legacy17")), "--sdk", "8.0", "-o", str(out), "--seq-len", "8",
                 "--passes", ",".join(PASSES), "--overwrite", "--converter-cmd", STANDIN_CMD])
    assert code == 130 and "mtkc: interrupted" in capsys.readouterr().err
    assert files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_converter_failure_exit_3_puts_complete_output_with_logs_in_place(exported, previous, tmp_path):
    """The compile succeeded, the converter did not: OUT is replaced by the complete new folder, whose
    logs/ hold what the converter said, with paths relative to OUT (no staging or absolute OUT path)."""
    out, _ = previous
    with pytest.raises(ConverterError, match=r"converter failed on partition model/npu\d+ .* see logs/model\.npu\d+\.log"):
        compile_model(exported("qwen2", "legacy17"), "8.0", out,
                      {**NEW, "no_convert": False, "converter_cmd": f"{STANDIN_CMD} --reject-op Softmax"})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["seq_len"] == 8 and manifest["converter"]["ran"]
    logs = sorted((out / "logs").iterdir())
    assert [p.name for p in logs] == [f"model.{r['id']}.log" for r in manifest["converter"]["partitions"]]
    for log in logs:
        text = log.read_text()
        assert text.startswith(f"$ {sys.executable} {STANDIN} --input model.") and " --output dla/model." in text
        assert str(tmp_path) not in text and ".mtkc-" not in text
    assert {"convert.sh", "report.md", "model.placement.json"} <= set(files(out))
    script = (out / "convert.sh").read_text()  # paths relative to the script's folder: valid after the swap
    assert '--input "$OUT"/model.npu' in script and str(tmp_path) not in script and ".mtkc-" not in script
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_sigkill_at_random_points_never_leaves_a_half_output(exported, previous, tmp_path):
    """`mtkc compile --overwrite` (stand-in converter included) killed at seeded random instants: OUT
    is the previous output or the complete new one; the next run removes the dead run's staging."""
    out, before = previous
    model = exported("qwen2", "legacy17")
    argv = [sys.executable, "-m", "mtkc", "compile", str(model), "--sdk", "8.0", "-o", str(out), "--seq-len", "8",
            "--passes", ",".join(PASSES), "--overwrite", "-q", "--converter-cmd", STANDIN_CMD]
    ref = tmp_path / "ref"
    start = time.monotonic()
    subprocess.run(argv[:8] + [str(ref)] + argv[9:], check=True, timeout=300)
    duration = time.monotonic() - start
    after = files(ref)
    rng = random.Random(0)
    seen = set()
    for delay in [0.2 * duration] + sorted(rng.uniform(0.3, 1.1) * duration for _ in range(3)):
        proc = subprocess.Popen(argv)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        now = files(out)
        assert now in (before, after), f"half-written OUT after SIGKILL at {delay:.2f}s of {duration:.2f}s"
        seen.add("after" if now == after else "before")
    subprocess.run(argv, check=True, timeout=300)
    assert files(out) == after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]  # stale staging of killed runs removed
    assert "before" in seen  # the first kill (at 20%) landed before the swap


# ---------------------------------------------------------------------------- mtkc.backend.staging on plain folders


def _fill(folder: Path, text: str) -> None:
    """A folder as mtkc writes it (its manifest marked), holding report.md = `text`."""
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"schema_version": 1, "mtkc": "0"}))
    (folder / "report.md").write_text(text)


@pytest.mark.parametrize("exchange", [True, False])
def test_staged_replaces_an_existing_folder(tmp_path, monkeypatch, exchange):
    from mtkc.backend import staging

    if not exchange:  # a file system without RENAME_EXCHANGE: two renames
        monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    _fill(tmp_path / "out", "old")
    with staging.staged(tmp_path / "out", overwrite=True) as stage:
        (stage / "report.md").write_text("new")
    assert (tmp_path / "out" / "report.md").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staged_fallback_puts_the_previous_folder_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    from mtkc.backend import staging

    monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    _fill(tmp_path / "out", "old")
    real = staging.os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".out.mtkc-") and Path(dst) == tmp_path / "out":
            raise OSError(5, "I/O error")
        real(src, dst)

    monkeypatch.setattr(staging.os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):  # EIO: not the user's doing, stays an OSError
        with staging.staged(tmp_path / "out", overwrite=True) as stage:
            (stage / "report.md").write_text("new")
    assert (tmp_path / "out" / "report.md").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staged_removes_staging_of_dead_processes_only(tmp_path):
    import os

    from mtkc.backend import staging

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        _fill(tmp_path / f".out.mtkc-{pid}-x", "half")
    _fill(tmp_path / ".other.mtkc-1-x", "not ours")
    with staging.staged(tmp_path / "out", overwrite=False) as stage:
        (stage / "report.md").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.mtkc-1-x", f".out.mtkc-{os.getpid()}-x", "out"]


def test_a_command_sweeps_the_collector_less_and_restores_its_thresholds(monkeypatch):
    """While a command runs the young-generation threshold is `GC_YOUNG`, and check and compile run
    without automatic collection; after it (also after an error) the host's settings are back: mtkc
    as a library or under pytest is left as it was."""
    import gc

    from mtkc import cli
    from mtkc.commands import check, sdks

    before, during = gc.get_threshold(), []
    monkeypatch.setattr(sdks, "run", lambda args: during.append((gc.get_threshold(), gc.isenabled())) or 0)
    assert main(["sdks"]) == 0 and during == [((cli.GC_YOUNG, *before[1:]), True)]
    monkeypatch.setattr(check, "run", lambda args: during.append(gc.isenabled()) or 0)
    assert main(["check", "m.onnx", "--sdk", "8.0"]) == 0 and during[-1] is False and gc.isenabled()
    monkeypatch.setattr(sdks, "run", lambda args: (_ for _ in ()).throw(InputError("bad")))
    assert main(["sdks"]) == 2 and gc.get_threshold() == before
    monkeypatch.setattr(check, "run", lambda args: (_ for _ in ()).throw(InputError("bad")))
    assert main(["check", "m.onnx", "--sdk", "8.0"]) == 2 and gc.isenabled() and gc.get_threshold() == before
