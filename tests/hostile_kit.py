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
import json
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
from mtkc.pipeline.calibrate import save_npz

WORDS = 2000  # make_tokenizer's words t0..t1999 (the tiny LLM exports' vocabulary is 1000)


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


def calibrate_by_hand(out: Path, samples: int = 2) -> None:
    """A calibration set as `mtkc calibrate` writes it, for a compile without an LLM (no run needed)."""
    manifest = json.loads((out / "manifest.json").read_text())
    rng = np.random.default_rng(0)
    counts, index = {}, []
    for graph in manifest["graphs"]:
        for part in graph["partitions"]:
            if part["target"] != "npu":
                continue
            name = f"{graph['name']}.{part['id']}"
            (out / "calibration" / name).mkdir(parents=True)
            for k in range(samples):
                save_npz(out / "calibration" / name / f"{k:04d}.npz",
                         {i["name"]: rng.standard_normal(i["shape"]).astype(i["dtype"]) for i in part["inputs"]})
                index.append({"dir": name, "file": f"{k:04d}.npz", "prompt": 0, "graph": graph["name"], "step": k})
            counts[name] = samples
    (out / "calibration" / "index.json").write_text(json.dumps({"prompts": [{"ids": [1, 2, 3]}], "decode_steps": 0,
                                                                "samples": index}))
    (out / "calibration" / "ranges.json").write_text("{}")
    manifest["calibration"] = {"path": "calibration", "index": "calibration/index.json",
                               "ranges": "calibration/ranges.json", "prompts": 1, "decode_steps": 0, "samples": counts}
    (out / "manifest.json").write_text(json.dumps(manifest))


def make_tokenizer(folder: Path, chat_template: str | None = None, **config) -> Path:
    """A word-level tokenizer folder (t0..t1999, whitespace split), optionally with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(WORDS)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    if config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder
