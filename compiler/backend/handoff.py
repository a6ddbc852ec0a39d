"""Hand each NPU partition to a converter, capture what it says, and map failures back to nodes.

Back ends, each driven only when present (never pretend a conversion ran):

    --converter-cmd TEMPLATE     the user's command, one run per NPU partition
    mtk_converter (Python)   ┐   MediaTek's chain: ONNX -> TFLite (op export spec of the SDK),
    mtk_onnx_converter (CLI) ┴─► then ncc-tflite -> .dla; commands from the SDK table [converter]
    neither / --no-convert       nothing runs; OUT/convert.sh holds the exact commands

Templates are split with shlex first, then each token is filled in ({input} {output} {arch}
{sdk} {input_names} {input_shapes} {onnx} {tflite} {dla}), and run without a shell. A failure is
pinned on nodes: names found in the log, else op types found in the log, else bisection of the
partition (prefixes of its topological order) with the converter as the oracle, bounded runs.
A converter that is broken is told apart and no node is blamed: it exits 0 without writing its
output, runs past `--converter-timeout`, or also fails on a trivial one-node graph (probed before
bisecting). Each run is its own process group, killed on timeout, Ctrl-C or SIGTERM, and on Linux
the converter gets SIGKILL when mtkc dies, even by SIGKILL (a parent-death signal); only the head
and tail of its output are kept (`LOG_HEAD` + `LOG_TAIL` bytes).
Commands run inside OUT with paths relative to it (a relative program or script path in the
template is made absolute first), so logs name no absolute or staging path.
Logs: OUT/logs/<graph>.<partition>.log; outputs: OUT/dla/.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import onnx
import onnx_graphsurgeon as gs

from mtkc.ir.outdir import PLAIN_NAME
from mtkc.backend.partition import Partition
from mtkc.backend.stitch import boundaries
from mtkc.errors import ConverterError, InputError
from mtkc.interrupts import GROUPS, die_with, kill_group
from mtkc.ir.model import load

PLACEHOLDERS = ("input", "output", "arch", "sdk", "input_names", "input_names_json", "input_shapes", "onnx", "tflite",
                "dla", "calibration", "precision", "python")
SCRIPT = "convert.sh"
PATH_KEYS = ("input", "output", "onnx", "tflite", "dla", "calibration")
OUT_MARK = "@MTKC_OUT@"  # stands for "$OUT" in convert.sh (shlex-safe characters)
PYTHON_MARK = "@MTKC_PYTHON@"  # {python}: mtkc's interpreter when mtkc runs a step, "$PYTHON" in convert.sh
MAX_BISECT_RUNS = 12  # 2**12 nodes pinned to one
DEFAULT_TIMEOUT = 4 * 3600.0  # seconds per converter run; a real 7B partition takes minutes
LOG_HEAD = LOG_TAIL = 64 << 10  # bytes of converter output kept from its start and its end
ERROR_LINE = re.compile(r"error|unsupport|not support|fail|fallback|invalid", re.IGNORECASE)

# MediaTek's Python API, run in a child process so a crash in it cannot take mtkc down.
PY_CONVERT = """\
import json, sys, mtk_converter
src, dst, spec, names, shapes = sys.argv[1:6]
converter = mtk_converter.OnnxConverter.from_model_proto_file(
    src, input_names=json.loads(names),
    input_shapes=[[int(d) for d in s.split(',') if d] for s in shapes.split(':')])
converter.convert_to_tflite(output_file=dst, tflite_op_export_spec=spec)
"""


@dataclass
class Backend:
    """A named converter: its command templates (token lists) run in order per partition."""

    name: str
    steps: list[list[str]]
    runnable: bool
    reason: str = ""  # why it cannot run (when not runnable)
    modules: tuple[str, ...] = ()  # Python modules its {python} steps import (convert.sh checks them first)


@dataclass
class Job:
    graph: str
    id: str
    onnx: str  # relative to OUT
    input_names: list[str]
    input_shapes: list[list]

    @property
    def key(self) -> str:
        return f"{self.graph}.{self.id}"

    def values(self) -> dict[str, str]:
        """Placeholder values; paths relative to OUT (the converter runs there; the script adds "$OUT"/)."""
        return {
            "input": self.onnx,
            "onnx": self.onnx,
            "output": f"dla/{self.key}.dla",
            "dla": f"dla/{self.key}.dla",
            "tflite": f"dla/{self.key}.tflite",
            "input_names": ",".join(self.input_names),
            "input_names_json": json.dumps(self.input_names),  # names may hold commas
            "input_shapes": ":".join(",".join(str(d) for d in s) for s in self.input_shapes),
            "calibration": f"calibration/{self.key}",  # the partition's samples (`mtkc calibrate`)
        }


@dataclass
class Handoff:
    """The manifest's `converter` section and the error to raise (after OUT is complete), if any."""

    section: dict
    error: ConverterError | None = None


@dataclass
class Outcome:
    job: Job
    exit_code: int
    log: str
    blame: dict = field(default_factory=dict)


def jobs(manifest: dict) -> list[Job]:
    """One job per NPU partition, in manifest order."""
    return [
        Job(g["name"], p["id"], p["path"], [i["name"] for i in p["inputs"]], [i["shape"] or [] for i in p["inputs"]])
        for g in manifest.get("graphs", []) for p in g.get("partitions", []) if p["target"] == "npu"
    ]


def command_backend(template: str) -> Backend:
    """The user's `--converter-cmd`; unknown placeholders are an InputError before anything runs."""
    try:
        tokens = shlex.split(template)
    except ValueError as exc:
        raise InputError(f"--converter-cmd: cannot split '{template}': {exc}") from None
    if not tokens:
        raise InputError("--converter-cmd: empty command")
    _check_placeholders(tokens, "--converter-cmd")
    tokens = [os.path.abspath(t) if "{" not in t and "/" in t and os.path.exists(t) else t for t in tokens]
    runnable = bool(shutil.which(tokens[0]) or Path(tokens[0]).is_file())
    return Backend("command", [tokens], runnable, "" if runnable else f"'{tokens[0]}' not found")


def mediatek_backend(converter: Mapping[str, str]) -> Backend:
    """MediaTek's chain from the SDK table's [converter] templates, Python API preferred."""
    convert = shlex.split(converter.get("convert", ""))
    compile_ = shlex.split(converter.get("compile", ""))
    if not convert or not compile_:
        return Backend("mediatek", [t for t in (convert, compile_) if t], False, "the SDK table has no [converter] commands")
    _check_placeholders(convert + compile_, "SDK table [converter]")
    if not shutil.which(compile_[0]):
        return Backend("mediatek", [convert, compile_], False, f"{compile_[0]} not found")
    if importlib.util.find_spec("mtk_converter") is not None:
        python = ["{python}", "-c", PY_CONVERT, "{onnx}", "{tflite}", _export_spec(convert), "{input_names_json}",
                  "{input_shapes}"]
        return Backend("mediatek-python", [python, compile_], True, modules=("mtk_converter",))
    if shutil.which(convert[0]):
        return Backend("mediatek-cli", [convert, compile_], True)
    return Backend("mediatek", [convert, compile_], False, f"neither mtk_converter (Python) nor {convert[0]} found")


def run(
    out: str | Path,
    manifest: dict,
    converter: Mapping[str, str] | None = None,
    converter_cmd: str | None = None,
    no_convert: bool = False,
    max_bisect_runs: int = MAX_BISECT_RUNS,
    timeout: float | None = None,
    quant=None,
) -> Handoff:
    """Write OUT/convert.sh, run the converter on every NPU partition when one is present.
    `quant`: a `mtkc.backend.quant_handoff.Quant` (the MediaTek back end then quantises)."""
    out = Path(out).resolve()
    backend = command_backend(converter_cmd) if converter_cmd else (
        quant.backend(converter or {}) if quant else mediatek_backend(converter or {}))
    todo = jobs(manifest)
    _check_jobs(backend, todo)
    context = {"arch": str(manifest.get("arch") or ""), "sdk": str(manifest.get("sdk") or ""),
               "timeout": DEFAULT_TIMEOUT if timeout is None else float(timeout),
               "precision": quant.precision if quant else "", "python": sys.executable}
    _write_script(out / SCRIPT, backend, todo, context)
    section = {"backend": backend.name, "commands": [shlex.join(s) for s in backend.steps], "script": SCRIPT,
               **(quant.section() if quant else {})}
    if not todo:
        return Handoff({**section, "ran": False, "reason": "no NPU partition to convert"})
    if no_convert or not backend.runnable:
        reason = "--no-convert" if no_convert else backend.reason
        return Handoff({**section, "ran": False, "reason": f"{reason}; run {SCRIPT} to convert"})
    (out / "logs").mkdir(exist_ok=True)
    (out / "dla").mkdir(exist_ok=True)
    outcomes = []
    for job in todo:
        code, text, broken = _execute(backend, job, out, context)
        log = f"logs/{job.key}.log"
        (out / log).write_text(text)
        outcome = Outcome(job, code, log)
        if broken:
            outcome.blame = {"method": "broken", "reason": broken}
        elif code != 0:
            outcome.blame = blame(out, job, text, lambda probe: _fails(backend, probe, out, context), max_bisect_runs)
        outcomes.append(outcome)
    section.update(ran=True, partitions=[_summary(o) for o in outcomes])
    failed = [o for o in outcomes if o.exit_code != 0]
    return Handoff(section, _error(failed) if failed else None)


def blame(out: Path, job: Job, log: str, fails, max_runs: int = MAX_BISECT_RUNS) -> dict:
    """The node(s) a failure is pinned on: named in the log, else by op type, else by bisection.

    Error-looking lines are searched first, so a verbose converter listing every node it
    visited does not blame them all.
    """
    proto = onnx.load(str(out / job.onnx), load_external_data=False)
    ops = {n.name: n.op_type for n in proto.graph.node}
    said = [line for line in log.splitlines() if not line.startswith("$ ")]  # not our own command line
    for lines in ([line for line in said if ERROR_LINE.search(line)], said):
        tokens = set(re.findall(r"[^\s'\"`,;()\[\]{}<>=]+", "\n".join(lines)))
        tokens |= {t.rstrip(":.") for t in tokens}
        named = [n for n in ops if n in tokens]
        if named:
            return {"method": "log-node", "nodes": named, "ops": sorted({ops[n] for n in named})}
        normal = {re.sub(r"[^A-Z0-9]", "", t.upper()) for t in tokens}
        found = sorted({op for op in ops.values() if op.upper() in normal})
        if found:
            return {"method": "log-op", "nodes": [n for n, op in ops.items() if op in found], "ops": found}
    return bisect(out, job, fails, max_runs)


def bisect(out: Path, job: Job, fails, max_runs: int) -> dict:
    """Smallest failing prefix of the partition's node order: its last node is the culprit.

    A prefix of a topological order is convex, so each probe is a valid partition; weights stay
    in the shared file (the probe is written beside it, in OUT, and removed).
    """
    graph = load(out / job.onnx).graph
    nodes = list(graph.nodes)
    lo, hi, runs = 1, len(nodes), 0
    probe = Job(job.graph, f"{job.id}.bisect", f".bisect.{job.key}.onnx", ["x"], [[1, 4]])
    try:
        onnx.save(_trivial_graph(graph.opset), out / probe.onnx)
        if fails(probe):  # it fails on anything: no node of ours is to blame
            return {"method": "broken", "reason": "it also fails on a trivial one-node graph (Relu)"}
        while lo < hi and runs < max_runs:
            mid = (lo + hi) // 2
            (inputs, outputs), _ = boundaries(graph, [Partition("a", "npu", nodes[:mid]), Partition("b", "npu", nodes[mid:])])
            sub = gs.Graph(nodes=nodes[:mid], inputs=inputs, outputs=outputs, opset=graph.opset,
                           import_domains=graph.import_domains, name=graph.name)
            onnx.save(gs.export_onnx(sub, do_type_check=False), out / probe.onnx)
            probe.input_names = [t.name for t in inputs]
            probe.input_shapes = [list(t.shape or []) for t in inputs]
            runs += 1
            if fails(probe):
                hi = mid
            else:
                lo = mid + 1
    finally:
        (out / probe.onnx).unlink(missing_ok=True)
    culprits = nodes[lo - 1:hi]
    return {"method": "bisect", "runs": runs, "nodes": [n.name for n in culprits], "ops": sorted({n.op for n in culprits})}


def _trivial_graph(opset: int) -> onnx.ModelProto:
    """y = Relu(x), x float [1,4]: any working converter converts it."""
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = h.make_graph([h.make_node("Relu", ["x"], ["y"], name="mtkc_probe_relu")], "mtkc_probe", [x], [y])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=8)


def _fails(backend: Backend, probe: Job, out: Path, context: dict) -> bool:
    """Converter as an oracle on a bisection probe; its outputs are removed."""
    code, _, broken = _execute(backend, probe, out, context)
    for key in ("dla", "tflite"):
        (out / probe.values()[key]).unlink(missing_ok=True)
    return code != 0 or bool(broken)


def _execute(backend: Backend, job: Job, out: Path, context: dict) -> tuple[int, str, str]:
    """Run every step for one job: (exit code, log text with each command, its output and exit code,
    why the converter itself is broken or "")."""
    values = {**context, **job.values()}
    lines = []
    for step in backend.steps:
        argv = [token.format_map(values) for token in step]
        lines.append(f"$ {shlex.join(argv)}")
        try:
            code, text = _run_bounded(argv, out, context["timeout"])
        except OSError as exc:
            lines.append(f"cannot run {argv[0]}: {exc.strerror or exc}")
            return 127, "\n".join(lines) + "\nexit code: 127\n", ""
        if not out.is_dir():
            raise InputError(f"the converter command '{argv[0]}' removed its working folder (the staging folder "
                             "of OUT); nothing was written")
        lines.append(text.rstrip("\n"))
        if code is None:
            lines.append(f"timed out after {context['timeout']:g} s: process group killed")
            return 124, "\n".join(lines) + "\n", f"it ran past --converter-timeout {context['timeout']:g} s"
        lines.append(f"exit code: {code}")
        if code != 0:
            return code, "\n".join(lines) + "\n", ""
    if not (out / f"dla/{job.key}.dla").exists() and any("{output}" in t or "{dla}" in t for s in backend.steps for t in s):
        lines.append("converter exited 0 but wrote no output file")
        return 1, "\n".join(lines) + "\n", f"it exited 0 without writing {job.values()['dla']}"
    return 0, "\n".join(lines) + "\n", ""


def _run_bounded(argv: list[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run `argv` in its own process group: (exit code or None on timeout, head + tail of its output).

    Whatever happens (timeout, Ctrl-C, SIGTERM raised as KeyboardInterrupt), the whole group is
    killed before this returns or raises, so no converter process outlives mtkc.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=cwd, start_new_session=True, preexec_fn=die_with(os.getpid()))
    GROUPS.add(proc.pid)
    log = _BoundedLog()
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, log.text()
            ready = select.select([fd], [], [], min(left, 0.2))[0]
            if ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    log.add(chunk)
                    continue
                break  # EOF: every writer is gone
            if proc.poll() is not None:  # it exited; a child it left may hold the pipe open
                while select.select([fd], [], [], 0)[0] and (chunk := os.read(fd, 1 << 16)):
                    log.add(chunk)
                break
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None, log.text()
        return code, log.text()
    finally:
        kill_group(proc)
        proc.stdout.close()


class _BoundedLog:
    """The first LOG_HEAD and the last LOG_TAIL bytes of a stream, and how many were dropped between."""

    def __init__(self):
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = max(0, LOG_HEAD - len(self.head))
        self.head += chunk[:room]
        chunk = chunk[room:]
        if chunk:
            self.tail.append(chunk)
            self.tail_bytes += len(chunk)
            while self.tail_bytes - len(self.tail[0]) >= LOG_TAIL:
                first = self.tail.popleft()
                self.tail_bytes -= len(first)
                self.dropped += len(first)

    def text(self) -> str:
        gap = f"\n[... {self.dropped} bytes of converter output omitted ...]\n" if self.dropped else ""
        return (bytes(self.head) + gap.encode() + b"".join(self.tail)).decode("utf-8", errors="replace")


def _check_jobs(backend: Backend, todo: list[Job]) -> None:
    """Before anything is written: partition names that become file names are plain, and no input
    name holds the comma `{input_names}` joins them with."""
    for job in todo:
        for what, name in (("graph", job.graph), ("partition", job.id)):
            if not PLAIN_NAME.fullmatch(name):
                raise InputError(f"manifest.json: {what} name '{name}' is not a plain name ({PLAIN_NAME.pattern}); "
                                 "nothing was written")
    if any("{input_names}" in t for s in backend.steps for t in s):
        for job in todo:
            bad = next((n for n in job.input_names if "," in n), None)
            if bad is not None:
                raise InputError(f"partition {job.key}: input '{bad}' holds a comma, which {{input_names}} "
                                 "cannot carry (use {input_names_json}, or rename the tensor)")


def _write_script(path: Path, backend: Backend, todo: list[Job], context: dict) -> None:
    """convert.sh: the exact commands, every value quoted, paths relative to the script's folder
    ("$OUT"), the interpreter `$MTKC_PYTHON` or `python3`; it checks what it needs first and
    talks on stderr. No mtkc needed to run it."""
    need = [(PYTHON_MARK if s[0] == "{python}" else s[0]) for s in backend.steps if s]
    lines = [
        "#!/bin/sh",
        f"# Written by mtkc: converts each NPU partition ({backend.name} back end).",
        "set -eu",
        "unset CDPATH",
        'PYTHON="${MTKC_PYTHON:-python3}"',
        "need() { printf 'convert.sh: %s\\n' \"$1\" >&2; exit 127; }",
    ]
    for program in dict.fromkeys(need):
        if program == PYTHON_MARK:
            lines.append('command -v "$PYTHON" >/dev/null 2>&1 || need "$PYTHON not found (set MTKC_PYTHON)"')
            for module in backend.modules:
                lines.append(f'"$PYTHON" -c {shlex.quote("import " + module)} 2>/dev/null || need '
                             f'"$PYTHON cannot import {module} (MediaTek NeuroPilot SDK); install it or set MTKC_PYTHON"')
        else:
            lines.append(f"command -v {shlex.quote(program)} >/dev/null 2>&1 || need "
                         + shlex.quote(f"{program} not found on PATH"))
    lines += ['OUT="$(cd -P -- "$(dirname -- "$0")" && pwd -P)"', 'mkdir -p "$OUT/dla"']
    for job in todo:
        values = {**context, **job.values(), "python": PYTHON_MARK}
        values.update((k, f"{OUT_MARK}/{values[k]}") for k in PATH_KEYS)
        lines.append(f"printf 'convert.sh: %s\\n' {shlex.quote(f'{job.graph}/{job.id}')} >&2")
        for step in backend.steps:
            lines.append(" ".join(_sh(t.format_map(values)) for t in step))
    lines.append(f"printf 'convert.sh: converted %s partition(s) into %s\\n' {len(todo)} \"$OUT/dla\" >&2")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def _sh(text: str) -> str:
    """Shell-quote one argument, letting OUT_MARK expand as "$OUT" and PYTHON_MARK as "$PYTHON"."""
    if text == PYTHON_MARK:
        return '"$PYTHON"'
    if OUT_MARK not in text:
        return shlex.quote(text)
    return '"$OUT"'.join(shlex.quote(piece) if piece else "" for piece in text.split(OUT_MARK))


def _check_placeholders(tokens: list[str], where: str) -> None:
    dummy = {k: "x" for k in PLACEHOLDERS}
    for token in tokens:
        try:
            token.format_map(dummy)
        except KeyError as exc:
            raise InputError(f"{where}: unknown placeholder {{{exc.args[0]}}}; known: "
                             + " ".join(f"{{{p}}}" for p in PLACEHOLDERS)) from None
        except (ValueError, IndexError):
            raise InputError(f"{where}: malformed braces in '{token}'") from None


def _export_spec(convert: list[str]) -> str:
    """The TFLite op export spec named in the table's convert command (`npsdk_vN`)."""
    for k, token in enumerate(convert):
        if token.startswith("--tflite_op_export_spec"):
            return token.partition("=")[2] or convert[k + 1]
    return "builtin_first"


def _summary(o: Outcome) -> dict:
    item = {"graph": o.job.graph, "id": o.job.id, "exit_code": o.exit_code, "log": o.log}
    if o.exit_code == 0:
        item["output"] = f"dla/{o.job.key}.dla"
    else:
        item["blame"] = o.blame
    return item


def _error(failed: list[Outcome]) -> ConverterError:
    first = failed[0]
    more = f"; {len(failed) - 1} more partition(s) failed" if len(failed) > 1 else ""
    if first.blame.get("method") == "broken":
        return ConverterError(f"the converter is broken, not a node: on partition {first.job.graph}/{first.job.id} "
                              f"{first.blame['reason']} (exit {first.exit_code}); see {first.log}{more}")
    nodes = first.blame.get("nodes", [])
    if not nodes:
        return ConverterError(f"converter failed on partition {first.job.graph}/{first.job.id} "
                              f"(exit {first.exit_code}); see {first.log}{more}")
    shown = ", ".join(f"'{n}'" for n in nodes[:3]) + (f" (+{len(nodes) - 3} more)" if len(nodes) > 3 else "")
    how = {"log-node": "named in its log", "log-op": "op type named in its log", "bisect": "found by bisection"}
    return ConverterError(
        f"converter failed on partition {first.job.graph}/{first.job.id} (exit {first.exit_code}) at node {shown} "
        f"[{'/'.join(first.blame.get('ops', []))}, {how.get(first.blame.get('method'), '?')}]; see {first.log}{more}"
    )
