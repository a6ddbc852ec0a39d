"""The weights file's copies run in a process of their own (`mtkc.ir.copier`) while compile builds
the next graph: the file is the same whatever the timing, a failed copy is the error a synchronous
one was, and a compile that fails after its first graph was written leaves nothing behind. (The
child is forked inside the test, by compile or on the first flush, so the test's monkeypatching
reaches it.)"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from mtkc.cli import main
from mtkc.errors import ExternalDataError, InputError
from mtkc.interrupts import GROUPS
from mtkc.ir import copier, weights
from mtkc.pipeline import build as B
from mtkc.pipeline.compile import compile_model

RNG = np.random.default_rng(3)


def _external(name: str, array: np.ndarray, location: str) -> onnx.TensorProto:
    t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=array.shape,
                         data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _graph_of(folder, tensors: dict[str, np.ndarray]) -> gs.Graph:
    """Y_i = Identity(T_i), each T_i external in its own file under `folder`."""
    nodes, outputs = [], []
    for name, array in tensors.items():
        (folder / f"{name}.bin").write_bytes(array.tobytes())
        const = gs.Constant(name, gs.ir.tensor.LazyValues(_external(name, array, f"{name}.bin")))
        y = gs.Variable(f"Y_{name}", np.float32, array.shape)
        nodes.append(gs.Node("Identity", name=f"id_{name}", inputs=[const], outputs=[y]))
        outputs.append(y)
    return gs.Graph(nodes=nodes, outputs=outputs, opset=17)


def _slow_copies(monkeypatch, seconds: float = 0.2):
    real = copier.copy_range

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(copier, "copy_range", slow)


def test_equal_tensors_from_two_files_are_stored_once_even_while_the_first_is_still_copying(tmp_path, monkeypatch):
    # B's head and tail match A's: dedup reads A back from the weights file, so it must wait for A's copy
    a = RNG.standard_normal(4096).astype(np.float32)
    other = a.copy()
    other[2000] += 1.0  # same length, head and tail, other middle: stored too
    src = tmp_path / "src"
    src.mkdir()
    graph = _graph_of(src, {"A": a, "B": a.copy(), "C": other})
    _slow_copies(monkeypatch)
    proto = weights.save(graph, src, tmp_path / "out" / "model.onnx")
    offsets = {t.name: {e.key: e.value for e in t.external_data}["offset"] for t in _initializers(proto)}
    assert offsets["A"] == offsets["B"] != offsets["C"]
    data = (tmp_path / "out" / "model.onnx.data").read_bytes()
    assert data == a.tobytes() + other.tobytes()  # 16384 bytes each, aligned: no padding


def _initializers(proto):
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
    yield from proto.graph.initializer


def test_a_copy_that_fails_in_the_copier_names_the_tensor_and_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    graph = _graph_of(src, {"A": RNG.standard_normal(1024).astype(np.float32)})

    def truncated(*args):
        raise ExternalDataError("external data is truncated")

    monkeypatch.setattr(copier, "copy_range", truncated)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"src/A\.bin: tensor 'A': external data is truncated"):
        weights.save(graph, src, out / "model.onnx")
    assert os.listdir(out) == []


def test_a_full_disk_the_idle_sync_reports_is_raised_as_the_os_said(tmp_path, monkeypatch):
    (tmp_path / "src").write_bytes(b"x" * 4096)
    (tmp_path / "synced").mkdir()

    def full(fd):
        (tmp_path / "synced" / "now").touch()  # the child's: seen here on disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(copier.os, "fdatasync", full)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        c = copier.Copier()
        c.put(src.fileno(), dst.fileno(), 0, 4096, 0, "src")
        c.flush()
        end = time.monotonic() + 10
        while not (tmp_path / "synced" / "now").exists():  # the queue ran dry: the child synced
            assert time.monotonic() < end
            time.sleep(0.01)
        with pytest.raises(OSError, match="No space left"):
            c.finish()
    assert (tmp_path / "dst").read_bytes() == b"x" * 4096


def test_a_cancelled_copier_stops_and_closes_what_it_held(tmp_path, monkeypatch):
    (tmp_path / "src").write_bytes(b"y" * 4096)
    _slow_copies(monkeypatch, 0.1)
    before = len(os.listdir("/proc/self/fd"))
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        c = copier.Copier()
        for i in range(20):
            c.put(src.fileno(), dst.fileno(), 0, 4096, i * 4096, "src")
        c.flush()
        child = c._pid
        c.cancel()  # the copy under way ends, the 19 queued are dropped
        with pytest.raises(ChildProcessError):  # killed and reaped
            os.waitpid(child, 0)
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.path.getsize(tmp_path / "dst") <= 2 * 4096


def test_copies_run_beside_a_caller_holding_the_gil(tmp_path):
    """The reason for a process: a thread needs the GIL back after every copy, and a caller inside
    a long C call (ONNX's shape inference) keeps it. Here the caller holds it in one C call (a
    regex over a pathological input) while 64 copies must finish."""
    import re

    data = RNG.integers(0, 256, 64 * 4096, dtype=np.uint8).tobytes()
    (tmp_path / "src").write_bytes(data)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        c = copier.Copier()
        for i in range(64):
            c.put(src.fileno(), dst.fileno(), i * 4096, 4096, i * 4096, "src")
        c.flush()
        started = time.perf_counter()
        re.match(r"(a|aa)+$", "a" * 34 + "b")  # about a second in C, the GIL held throughout
        held = time.perf_counter() - started
        waited = time.perf_counter()
        c.wait(dst.fileno(), len(data))
        assert time.perf_counter() - waited < held / 4  # done while the caller held the GIL
        c.finish()
    assert (tmp_path / "dst").read_bytes() == data


@pytest.fixture
def kv_model(exported):
    return exported("qwen2", "legacy17", cache=True)


def _listing(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def _fail_second_graph(monkeypatch, error=InputError):
    real, calls = B.build_graph, []

    def build_graph(*args, **kwargs):
        calls.append(args[1])
        if args[1] == "decode":
            raise error(f"graph '{args[1]}': refused for the test")
        return real(*args, **kwargs)

    monkeypatch.setattr(B, "build_graph", build_graph)
    return calls


@pytest.mark.parametrize("error", [InputError, KeyboardInterrupt])
def test_a_later_graph_failing_after_the_first_was_written_leaves_nothing(error, kv_model, tmp_path, monkeypatch):
    parent = tmp_path / "parent"
    parent.mkdir()
    stages = []
    real_export = weights.WeightWriter.export

    def export(self, graph, root, path, opset=None):
        stages.append(os.listdir(path.parent))  # the first graph is written before the second is built
        return real_export(self, graph, root, path, opset)

    monkeypatch.setattr(weights.WeightWriter, "export", export)
    calls = _fail_second_graph(monkeypatch, error)
    options = {"seq_len": 8, "cache_len": 16, "no_convert": True}
    with pytest.raises(error, match="refused for the test"):
        compile_model(kv_model, "8.0", parent / "out", options)
    assert calls == ["prefill", "decode"] and stages  # prefill went to the staging folder first
    assert _listing(parent) == []  # no OUT, no staging, no weights file
    assert not GROUPS  # its copies stopped: the copier's child killed and reaped
    missing = tmp_path / "missing" / "deeper"
    with pytest.raises(error, match="refused for the test"):
        compile_model(kv_model, "8.0", missing / "out", options)
    assert not (tmp_path / "missing").exists()  # no parent folder was made for a build that failed


def test_writing_each_graph_as_it_is_built_gives_the_bytes_of_writing_them_at_the_end(kv_model, tmp_path):
    options = {"seq_len": 8, "cache_len": 16, "no_convert": True}
    (tmp_path / "here").mkdir()
    early = compile_model(kv_model, "8.0", tmp_path / "here" / "out", options).out_dir  # parent exists: eager
    late = compile_model(kv_model, "8.0", tmp_path / "new" / "out", options).out_dir  # parent made at the end
    files = _listing(early)
    assert files == _listing(late) and "weights.bin" in files and "decode.onnx" in files
    for name in files:
        if (early / name).is_file() and name != "report.json":  # report.json carries pass timings
            assert (early / name).read_bytes() == (late / name).read_bytes(), name


def test_a_cancel_stops_a_large_copy_at_once(tmp_path, monkeypatch):
    (tmp_path / "src").write_bytes(bytes(64 * 1024))
    _slow_copies(monkeypatch, 5.0)  # one copy that would take 5 s
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        c = copier.Copier()
        c.put(src.fileno(), dst.fileno(), 0, 64 * 1024, 0, "src")
        c.flush()
        time.sleep(0.1)
        started = time.perf_counter()
        c.cancel()
        assert time.perf_counter() - started < 0.3
    assert os.path.getsize(tmp_path / "dst") < 64 * 1024


def test_an_external_data_export_compiles_to_the_bytes_of_its_inline_twin(kv_model, tmp_path):
    # the twin's weights are copied file-to-file by the copier; the inline export's are
    # written from memory in the caller's (no copier): the same bytes make the two paths check each other
    twin = tmp_path / "twin" / "model.onnx"
    twin.parent.mkdir()
    onnx.save(onnx.load(kv_model), twin, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=1024)
    assert len(os.listdir(twin.parent)) > 10  # one file per weight, as the TorchScript exporter writes them
    options = {"seq_len": 8, "cache_len": 16, "no_convert": True}
    inline = compile_model(kv_model, "8.0", tmp_path / "inline", options).out_dir
    external = compile_model(twin, "8.0", tmp_path / "external", options).out_dir
    files = _listing(inline)
    assert files == _listing(external) and "host/embedding.npy" in files
    for name in files:
        if (inline / name).is_file() and name not in ("report.json", "manifest.json"):  # the input's path, timings
            assert (inline / name).read_bytes() == (external / name).read_bytes(), name
    a, b = (json.loads((out / "manifest.json").read_text()) for out in (inline, external))
    assert {k: v for k, v in a.items() if k != "model"} == {k: v for k, v in b.items() if k != "model"}


def test_a_full_disk_during_a_copy_names_the_output_folder(kv_model, tmp_path, monkeypatch):
    twin = tmp_path / "twin" / "model.onnx"
    twin.parent.mkdir()
    onnx.save(onnx.load(kv_model), twin, save_as_external_data=True, size_threshold=1024)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(copier, "copy_range", full)
    out = tmp_path / "here" / "out"
    out.parent.mkdir()
    with pytest.raises(InputError, match=r"here/out: cannot write the output folder: No space left on device"):
        compile_model(twin, "8.0", out, {"seq_len": 8, "cache_len": 16, "no_convert": True})
    assert _listing(out.parent) == []


_SPY = """
import sys
from mtkc.ir import copier
fork = copier._fork
def spy():
    print("copier forked with onnx imported" if "onnx" in sys.modules else "copier forked before onnx", file=sys.stderr)
    return fork()
copier._fork = spy
from mtkc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_cli_forks_compile_s_copier_before_the_command_s_imports(kv_model, tmp_path):
    """The child holds the CLI's few modules, not onnx, numpy and the pipeline (its resident pages
    count again in a summed RSS); compile takes it, and forks no other."""
    twin = tmp_path / "twin" / "model.onnx"
    twin.parent.mkdir()
    onnx.save(onnx.load(kv_model), twin, save_as_external_data=True, size_threshold=1024)
    run = subprocess.run([sys.executable, "-c", _SPY, "compile", str(twin), "--sdk", "8.0", "--seq-len", "8",
                          "--cache-len", "16", "-o", str(tmp_path / "out"), "--no-convert"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("copier")] == ["copier forked before onnx"]
    assert (tmp_path / "out" / "weights.bin").stat().st_size > 0


@pytest.mark.parametrize("argv", [["compile", "--help"], ["compile", "missing.onnx", "--sdk", "8.0"]])
def test_a_compile_that_takes_no_copier_leaves_none(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # --help
        code = exc.code
    assert code in (0, 2) and copier._spare == [] and not GROUPS
