"""The `mtkc` process ends without collecting its graphs (`mtkc.cli.entry`): what it printed is all
there, its exit code is the command's, and a stdout it cannot write is the user's error (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mtkc.cli import main


def _mtkc(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtkc", *map(str, argv)], capture_output=True, timeout=300, **kwargs)


def test_the_process_prints_what_main_prints_and_exits_with_its_code(exported, capsys):
    model = exported("qwen2", "legacy17")
    argv = ["check", model, "--sdk", "8.0", "--seq-len", "8", "--format", "json"]
    assert main([str(a) for a in argv]) == 0
    in_process = capsys.readouterr().out
    r = _mtkc(*argv)
    assert r.returncode == 0 and r.stdout.decode() == in_process
    assert json.loads(r.stdout)["sdk"] == "8.0"
    strict = _mtkc(*argv, "--strict")  # exit 1 when a node stays on the CPU: the code survives the fast exit
    assert strict.returncode == (1 if json.loads(r.stdout)["strict"] == "fail" else 0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["sdks"], ["passes"]])
def test_a_full_stdout_is_a_one_line_error_and_exit_2(command):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "mtkc", *command], stdout=full, stderr=subprocess.PIPE, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("mtkc: error: cannot write") and "No space left" in err
    assert err.count("\n") == 1 and "Traceback" not in err
