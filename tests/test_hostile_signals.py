"""Hostile cases that need a real process: Ctrl-C into a plugin stuck in a loop, SIGTERM while
the converter runs, check killed while its worker builds decode. Exit 130, nothing left behind (no
OUT, no staging, no converter or worker process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hostile_kit import save, tiny, with_cpu_node


def _start(args, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mtkc", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


LOOPS = {
    "busy-loop": "while True:\n    pass\n",
    "swallows-keyboard-interrupt": "while True:\n    try:\n        time.sleep(0.01)\n    except BaseException:\n        pass\n",
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_ctrl_c_stops_a_plugin_stuck_in_a_loop(tmp_path, loop):
    """A second Ctrl-C ends even a plugin that swallows the first one."""
    plugin = tmp_path / "stuck.py"
    plugin.write_text(textwrap.dedent("""\
        import pathlib, time
        from mtkc.rewrite.pass_api import Pass, PassResult, register

        @register
        class Stuck(Pass):
            name = "stuck"
            description = "never returns"

            def run(self, graph, ctx):
                pathlib.Path("started").touch()
        """) + textwrap.indent(LOOPS[loop], " " * 8))
    model = save(tiny(), tmp_path / "m.onnx")
    proc = _start(["compile", model, "--sdk", "8.0", "-o", tmp_path / "out", "--plugin", plugin], tmp_path)
    _wait_for(tmp_path / "started")
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "mtkc: interrupted", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "started", "stuck.py"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_conversion_kills_the_converter_and_cleans_the_staging(tmp_path, sig):
    converter = tmp_path / "conv.py"
    converter.write_text(textwrap.dedent("""\
        import os, pathlib, sys, time
        pathlib.Path(os.environ["PIDFILE"]).write_text(str(os.getpid()))
        time.sleep(120)
        """))
    model = save(with_cpu_node("hm"), tmp_path / "m.onnx")
    pidfile = tmp_path / "converter.pid"
    env = {**os.environ, "PIDFILE": str(pidfile)}
    proc = subprocess.Popen([sys.executable, "-m", "mtkc", "compile", str(model), "--sdk", "8.0", "-o", str(tmp_path / "out"),
                             "--converter-cmd", f"{sys.executable} {converter} {{input}} {{output}}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(pidfile)
    time.sleep(0.2)
    converter_pid = int(pidfile.read_text())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "mtkc: interrupted" in err, err
    time.sleep(0.2)
    assert not _alive(converter_pid)  # no orphaned converter
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.py", "converter.pid", "m.onnx"]  # no OUT, no staging


def _worker_of(parent: int, timeout: float = 60) -> int:
    """The pid of `mtkc.pipeline.worker` started by `parent`, once it runs."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"mtkc.pipeline.worker" in cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                return int(entry.name)
        time.sleep(0.01)
    raise AssertionError("check never started its worker")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_check_s_worker_ends_with_it(tmp_path, exported, sig):
    """`check --jobs 2` killed (SIGTERM: exit 130; SIGKILL: the kernel's PDEATHSIG) leaves no worker."""
    proc = _start(["check", exported("qwen2", "legacy17", cache=True), "--sdk", "8.0", "--jobs", "2"], tmp_path)
    child = _worker_of(proc.pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == (130 if sig == signal.SIGTERM else -signal.SIGKILL), err
    end = time.monotonic() + 5
    while _running(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _running(child) and os.listdir(tmp_path) == []


def _running(pid: int) -> bool:
    """Alive and not a zombie (its new parent may be an init that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
