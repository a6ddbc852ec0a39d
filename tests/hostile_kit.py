"""Tools for the hostile corpus: tiny models built by code, an in-process CLI runner, and a
snapshot of a folder tree to prove what was (not) written.

Every case lives in its own folder of a shared arena; `Arena.run` runs `mtkc ARGS` in-process
(mtkc.cli.main) and checks the contract that holds for every case: the exit code expected, no
traceback, an error is exactly one line, every stderr line is mtkc's, and nothing outside the
case folder changed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mtkc.cli import main
from mtkc.display import EscapingFormatter


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17, functions=(), domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    return model


def tiny(x: str = "x", y: str = "y", mm: str = "mm", relu: str = "relu", w: str = "w") -> onnx.ModelProto:
    """y = Relu(x @ w), x float [1,4], w [4,4] (inline once compiled): every name can be chosen (hostile names)."""
    weight = numpy_helper.from_array((np.arange(16, dtype=np.float32).reshape(4, 4) - 8) / 10, w)
    return make_model(
        [helper.make_node("MatMul", [x, w], ["m"], name=mm), helper.make_node("Relu", ["m"], [y], name=relu)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, 4])],
        [weight],
    )


def with_cpu_node(name: str) -> onnx.ModelProto:
    """x [1,64] -> MatMul(w [64,64]: in weights.bin once compiled) -> Hardmax (in no SDK table: a CPU node
    named `name`) -> Relu -> y."""
    weight = numpy_helper.from_array((np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 7 - 3) / 10, "w")
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Hardmax", ["m"], ["h"], name=name),
         helper.make_node("Relu", ["h"], ["y"], name="relu")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple]:
    """{relative path: (kind, size, mtime_ns, link target)} of everything under `root` except `skip`."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            if skip is not None and p == skip:
                continue
            st = p.lstat()
            link = os.readlink(p) if p.is_symlink() else None
            found[str(p.relative_to(root))] = (p.is_dir(), st.st_size if not p.is_dir() else 0, st.st_mtime_ns, link)
    return found


def run_cli(args, cwd: Path | None = None) -> Outcome:
    """`mtkc ARGS` in this process: (exit code, stdout, stderr); log records land in stderr as the CLI writes them.
    The logger and the SIGINT/SIGTERM handlers `main` installs are restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    handler = logging.StreamHandler(err)
    handler.setFormatter(EscapingFormatter("%(message)s"))
    logger = logging.getLogger("mtkc")
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(here)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        logger.handlers, logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_contract(result: Outcome, code: int, says: str | None = None) -> None:
    """The exit code; no traceback; every stderr line is mtkc's; an error is one line and says `says`."""
    lines = result.err.splitlines()
    assert result.code == code, (result.code, result.err)
    assert "Traceback" not in result.err and "internal error" not in result.err, result.err
    assert all(line.startswith("mtkc") for line in lines), lines
    errors = [line for line in lines if line.startswith("mtkc: error:")]
    if code in (2, 3):
        assert len(errors) == 1, lines
    if says is not None:
        assert says in (errors[0] if errors else result.err + result.out), (says, lines)
