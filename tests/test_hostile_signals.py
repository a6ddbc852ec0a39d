"""Hostile cases that need a real process: Ctrl-C into a plugin stuck in a loop, SIGTERM while
the converter runs, check killed while its worker builds decode. Exit 130, nothing left behind (no
OUT, no staging, no converter or worker process)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hostile_kit import save, tiny, with_cpu_node

PR_SET_CHILD_SUBREAPER = 36


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


def _children_of(parent: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _set_up(pid: int) -> bool:
    """Whether the fork `pid` has become a worker: its stderr is /dev/null (`worker._child`), so its
    PDEATHSIG is set (`interrupts.fork` sets it first). A fork stopped before that would outlive a
    SIGKILLed check because the test stopped it, not because mtkc leaked it."""
    try:
        return os.readlink(f"/proc/{pid}/fd/2") == os.devnull
    except OSError:
        return False


def _stop_workers(parent: int, timeout: float = 60) -> set[int]:
    """SIGSTOP each child `parent` forks (check's workers, `mtkc.pipeline.worker`) as soon as it is
    set up, over 0.3 s from the first: check then waits for an answer that cannot come."""
    end, stopped, first = time.monotonic() + timeout, set(), None
    while time.monotonic() < end and (first is None or time.monotonic() < first + 0.3):
        for pid in {pid for pid in _children_of(parent) - stopped if _set_up(pid)}:
            os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
            first = first or time.monotonic()
        time.sleep(0.005)
    assert stopped, "check never started its workers"
    return stopped


@contextlib.contextmanager
def _adopting_orphans():
    """This process adopts its descendants' orphans (PR_SET_CHILD_SUBREAPER), so a worker that
    outlives check stays stopped and visible here (an orphaned stopped group would get SIGHUP from
    the kernel and hide the leak); afterwards every adopted one is killed and reaped."""
    prctl = ctypes.CDLL(None).prctl
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0)
        for pid in _children_of(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_check_s_worker_ends_with_it(tmp_path, exported, sig):
    """`check --jobs 2` killed (SIGTERM: exit 130; SIGKILL: the kernel's PDEATHSIG) while its workers
    run leaves none behind (they are stopped first, so check is surely still waiting for them)."""
    model = exported("qwen2", "legacy17", cache=True)
    with _adopting_orphans():
        for _ in range(3):  # a retry only if both workers answered before they were stopped (exit 0)
            proc = _start(["check", model, "--sdk", "8.0", "--jobs", "2"], tmp_path)
            children = _stop_workers(proc.pid)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
            if proc.returncode != 0:
                break
        assert proc.returncode == (130 if sig == signal.SIGTERM else -signal.SIGKILL), err
        end = time.monotonic() + 5
        while any(map(_running, children)) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(map(_running, children)) and os.listdir(tmp_path) == []


def _running(pid: int) -> bool:
    """Alive and not a zombie (its new parent may be an init that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
