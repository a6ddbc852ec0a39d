"""mtkc.ir.weights: graphs saved with one shared weights file, each tensor stored once, bytes
deterministic, numerics unchanged in onnxruntime, and the input model never overwritten."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from mtkc.errors import InputError
from mtkc.ir import copier, execute, weights
from mtkc.ir import model as mmodel

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 32)).astype(np.float32)  # 8192 bytes, external in the source
B = RNG.standard_normal((32,)).astype(np.float32)  # 128 bytes, external Constant attribute (optimum style)
X = RNG.standard_normal((2, 64)).astype(np.float32)


def _external(name, array, location, offset):
    t = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape,
                         data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


@pytest.fixture
def source(tmp_path) -> mmodel.Model:
    """Y = (X @ W + B) with W an external initializer and B an external Constant attribute."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.onnx_data").write_bytes(W.tobytes() + B.tobytes())
    nodes = [
        oh.make_node("MatMul", ["X", "W"], ["m"], name="mm"),
        oh.make_node("Constant", [], ["B"], name="const_b", value=_external("", B, "model.onnx_data", W.nbytes)),
        oh.make_node("Add", ["m", "B"], ["Y"], name="add"),
    ]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", 1, [2, 64])],
                          [oh.make_tensor_value_info("Y", 1, [2, 32])], [_external("W", W, "model.onnx_data", 0)])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    proto.ir_version = 8
    (folder / "model.onnx").write_bytes(proto.SerializeToString())
    return mmodel.load(folder / "model.onnx")


def _with_folded_constant(model: mmodel.Model, values: np.ndarray, name: str) -> gs.Graph:
    """The source graph plus `Y2 = Y @ C` with C an in-memory (folded) constant."""
    graph = model.graph.copy()
    y2 = gs.Variable("Y2", np.float32, [2, values.shape[1]])
    graph.nodes.append(gs.Node("MatMul", name=f"mm_{name}", inputs=[graph.outputs[0], gs.Constant(name, values)], outputs=[y2]))
    graph.outputs.append(y2)
    return graph


def _expected(c=None):
    y = X @ W + B
    return y if c is None else (y, y @ c)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_round_trip_numerics_in_onnxruntime_and_mtkc(source, tmp_path):
    c = RNG.standard_normal((32, 16)).astype(np.float32)  # 2048 bytes: stored externally
    graph = _with_folded_constant(source, c, "C")
    out = tmp_path / "out"
    with weights.WeightWriter(out) as writer:
        proto = writer.export(graph, source.root, out / "model.onnx", opset=18)
    assert sorted(os.listdir(out)) == ["model.onnx", "weights.bin"]
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 18)]
    with pytest.raises(ValueError, match="closed"):
        writer.export(graph, source.root, out / "again.onnx")
    y, y2 = _expected(c)
    via_mtkc = execute.run(proto, {"X": X}, root=out)
    via_disk = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"X": X})
    reloaded = mmodel.load(out / "model.onnx")
    via_load = execute.run(reloaded.graph, {"X": X}, root=reloaded.root)
    for got in (via_mtkc, dict(zip(["Y", "Y2"], via_disk)), via_load):
        np.testing.assert_allclose(got["Y"], y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["Y2"], y2, rtol=1e-5, atol=1e-5)
    # W (8192) at 0 and C (2048) at 8192 went external; B (128 bytes) was inlined from the source file.
    assert os.path.getsize(out / "weights.bin") == 8192 + 2048
    inits = {t.name: mmodel.external_info(t) for t in proto.graph.initializer}
    assert inits == {"W": {"location": "weights.bin", "offset": "0", "length": "8192"},
                     "C": {"location": "weights.bin", "offset": "8192", "length": "2048"}}
    b = proto.graph.node[1].attribute[0].t
    assert b.data_location == onnx.TensorProto.DEFAULT and b.raw_data == B.tobytes()
    assert os.path.getsize(out / "model.onnx") < 1024  # the graph carries references only


def test_two_graphs_share_one_copy_of_each_tensor(source, tmp_path):
    c = RNG.standard_normal((32, 24)).astype(np.float32)  # 3072 bytes
    prefill = _with_folded_constant(source, c, "C")
    decode = _with_folded_constant(source, c.copy(), "C_again")  # same bytes, other name and object
    out = tmp_path / "out"
    with weights.WeightWriter(out, "shared.bin", threshold=64) as writer:
        writer.export(prefill, source.root, out / "prefill.onnx")
        writer.export(decode, source.root, out / "decode.onnx")
    # W 8192 @0, C 3072 @8192, B 128 @11264 (aligned to 64) -> each once.
    assert os.path.getsize(out / "shared.bin") == 8192 + 3072 + 128
    for name in ("prefill", "decode"):
        got = execute.run(onnx.load(out / f"{name}.onnx", load_external_data=False), {"X": X}, root=out)
        np.testing.assert_allclose(got["Y2"], _expected(c)[1], rtol=1e-5, atol=1e-5)


def test_output_is_deterministic(source, tmp_path):
    c = RNG.standard_normal((32, 16)).astype(np.float32)
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        with weights.WeightWriter(out, align=4096) as writer:
            writer.export(_with_folded_constant(source, c, "C"), source.root, out / "prefill.onnx")
            writer.export(source.graph, source.root, out / "decode.onnx")
        outputs.append(_files(out))
    assert outputs[0] == outputs[1]
    assert len(outputs[0]["weights.bin"]) == 4096 * 2 + 2048  # W at 0, C aligned at 8192


def test_inline_source_weights_are_moved_out_and_deduplicated(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    inits = [oh.make_tensor(n, onnx.TensorProto.FLOAT, W.shape, W.tobytes(), raw=True) for n in ("W1", "W2")]
    nodes = [oh.make_node("MatMul", ["X", "W1"], ["a"]), oh.make_node("MatMul", ["X", "W2"], ["b"]),
             oh.make_node("Add", ["a", "b"], ["Y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", 1, [2, 64])],
                          [oh.make_tensor_value_info("Y", 1, [2, 32])], inits)
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), folder / "model.onnx")
    model = mmodel.load(folder / "model.onnx")
    proto = weights.save(model.graph, model.root, tmp_path / "out" / "model.onnx")
    assert os.path.getsize(tmp_path / "out" / "model.onnx.data") == W.nbytes  # one copy for two names
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    got = execute.run(proto, {"X": X}, root=tmp_path / "out")["Y"]
    np.testing.assert_allclose(got, 2 * (X @ W), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int8, np.bool_])
def test_in_memory_constants_of_every_dtype_round_trip(dtype, tmp_path):
    values = (RNG.standard_normal((16, 128)) > 0 if dtype is np.bool_ else RNG.standard_normal((16, 128)) * 10).astype(dtype)
    out_var = gs.Variable("Y", dtype, values.shape)
    graph = gs.Graph(nodes=[gs.Node("Identity", inputs=[gs.Constant("K", values)], outputs=[out_var])],
                     outputs=[out_var], opset=17)
    weights.save(graph, tmp_path, tmp_path / "out" / "model.onnx")
    reloaded = mmodel.load(tmp_path / "out" / "model.onnx")
    const = reloaded.graph.nodes[0].inputs[0]
    assert mmodel.external_info(const._values.tensor)["location"] == "model.onnx.data"
    np.testing.assert_array_equal(reloaded.values(const).view(np.uint8), values.view(np.uint8))


def _no_copy_file_range(*args):
    raise OSError(18, "Invalid cross-device link")


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_is_streamed_in_chunks(kernel_copy, tmp_path, monkeypatch):
    big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "data").write_bytes(big.tobytes())
    out_var = gs.Variable("Y", np.float32, big.shape)
    const = gs.Constant("big", gs.ir.tensor.LazyValues(_external("big", big, "data", 0)))
    graph = gs.Graph(nodes=[gs.Node("Identity", inputs=[const], outputs=[out_var])], outputs=[out_var], opset=17)
    monkeypatch.setattr(copier, "CHUNK", 1 << 20)
    if not kernel_copy:
        monkeypatch.setattr(os, "copy_file_range", _no_copy_file_range)
    tracemalloc.start()
    weights.save(graph, folder, tmp_path / "out" / "model.onnx")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # a whole-tensor read would be 16 MiB
    assert (tmp_path / "out" / "model.onnx.data").read_bytes() == big.tobytes()


def test_refuses_to_overwrite_the_input_weights(source, tmp_path):
    before = (source.root / "model.onnx_data").read_bytes()
    with pytest.raises(InputError, match="output weights file is the input's external data"):
        with weights.WeightWriter(source.root, "model.onnx_data") as writer:
            writer.export(source.graph, source.root, source.root / "copy.onnx")
    assert (source.root / "model.onnx_data").read_bytes() == before
    assert sorted(os.listdir(source.root)) == ["model.onnx", "model.onnx_data"]  # no temp file left


def test_error_inside_the_writer_leaves_nothing(source, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with weights.WeightWriter(out) as writer:
            writer.export(source.graph, source.root, out / "prefill.onnx")
            raise RuntimeError("a later pass failed")
    assert os.listdir(out) == []


def test_refuses_to_write_through_a_symlink(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (out / "weights.bin").symlink_to(victim)
    with pytest.raises(InputError, match="through a symlink"):
        with weights.WeightWriter(out) as writer:
            writer.export(source.graph, source.root, out / "model.onnx")
    assert victim.read_bytes() == b"keep"


def test_graph_files_must_sit_beside_the_weights(source, tmp_path):
    with pytest.raises(ValueError, match="directly into"):
        weights.WeightWriter(tmp_path / "out").export(source.graph, source.root, tmp_path / "out" / "sub" / "m.onnx")


def test_hostile_lazy_source_is_refused_at_export(source, tmp_path):
    """A graph built by hand (not through load) still cannot make the writer read outside root."""
    (tmp_path / "secret").write_bytes(W.tobytes())
    const = gs.Constant("W", gs.ir.tensor.LazyValues(_external("W", W, "../secret", 0)))
    out_var = gs.Variable("Y", np.float32, W.shape)
    graph = gs.Graph(nodes=[gs.Node("Identity", inputs=[const], outputs=[out_var])], outputs=[out_var], opset=17)
    with pytest.raises(InputError, match="escapes the model folder"):
        weights.save(graph, source.root, tmp_path / "out" / "model.onnx")
    assert not (tmp_path / "out" / "model.onnx.data").exists()


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy17", "dynamo", "hf"])
def test_tiny_qwen2_exports_round_trip(exporter, exported, tmp_path):
    model = mmodel.load(exported("qwen2", exporter))
    out = tmp_path / "out"
    proto = weights.save(model.graph, model.root, out / "model.onnx")
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer) >= 10
    feeds = execute.seeded_inputs(model.graph, seed=0)
    before = execute.run(model.graph, feeds, root=model.root)
    after = execute.run(mmodel.load(out / "model.onnx").graph, feeds, root=out)
    assert before.keys() == after.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)


def test_external_constant_inside_a_local_function_is_rewritten(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "w.data").write_bytes(W.tobytes())
    inner = oh.make_node("Constant", [], ["w"], name="fconst", value=_external("", W, "w.data", 0))
    func = oh.make_function("local", "F", ["x"], ["y"], [inner, oh.make_node("MatMul", ["x", "w"], ["y"])],
                            [oh.make_opsetid("", 17)])
    graph = oh.make_graph([oh.make_node("F", ["X"], ["Y"], name="call", domain="local")], "g",
                          [oh.make_tensor_value_info("X", 1, [2, 64])], [oh.make_tensor_value_info("Y", 1, [2, 32])])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)], functions=[func])
    proto.ir_version = 8
    (folder / "model.onnx").write_bytes(proto.SerializeToString())
    model = mmodel.load(folder / "model.onnx")
    saved = weights.save(model.graph, model.root, tmp_path / "out" / "model.onnx")
    attr = saved.functions[0].node[0].attribute[0].t
    assert mmodel.external_info(attr) == {"location": "model.onnx.data", "offset": "0", "length": "8192"}
    got = execute.run(saved, {"X": X}, root=tmp_path / "out")["Y"]
    np.testing.assert_allclose(got, X @ W, rtol=1e-5, atol=1e-5)


def _inline_model(folder: Path, arrays: dict[str, np.ndarray]) -> mmodel.Model:
    """Y = sum of X @ A over the inline (raw_data) initializers `arrays`."""
    folder.mkdir()
    inits = [oh.make_tensor(n, onnx.TensorProto.FLOAT, a.shape, a.tobytes(), raw=True) for n, a in arrays.items()]
    names = list(arrays)
    nodes = [oh.make_node("MatMul", ["X", n], [f"p{i}"]) for i, n in enumerate(names)]
    nodes += [oh.make_node("Sum", [f"p{i}" for i in range(len(names))], ["Y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("X", 1, [2, 64])],
                          [oh.make_tensor_value_info("Y", 1, [2, 32])], inits)
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), folder / "model.onnx")
    return mmodel.load(folder / "model.onnx")


def test_same_length_head_and_tail_but_other_middle_is_stored_twice(tmp_path):
    """Dedup candidates come from length + head/tail sample; only the full hash decides."""
    other = W.copy()
    other[32, 16] += 1  # byte 4160: outside the 4096-byte head and tail samples of 8192 bytes
    model = _inline_model(tmp_path / "src", {"W1": W, "W2": other, "W3": W.copy()})
    proto = weights.save(model.graph, model.root, tmp_path / "out" / "model.onnx")
    assert os.path.getsize(tmp_path / "out" / "model.onnx.data") == 2 * W.nbytes  # W1 = W3, W2 apart
    offsets = [dict((e.key, e.value) for e in t.external_data)["offset"] for t in proto.graph.initializer]
    assert offsets == ["0", "8192", "0"]
    got = execute.run(proto, {"X": X}, root=tmp_path / "out")["Y"]
    np.testing.assert_allclose(got, X @ W + X @ other + X @ W, rtol=1e-5, atol=1e-5)


def test_fresh_graphs_of_an_inline_model_share_stored_tensors_without_hashing(tmp_path, monkeypatch):
    """Unique inline weights are never hashed in full; a fresh graph's are found by TensorProto."""
    w2 = RNG.standard_normal(W.shape).astype(np.float32)
    model = _inline_model(tmp_path / "src", {"W1": W, "W2": w2})
    hashed = []
    real = weights.hashlib.sha256
    monkeypatch.setattr(weights.hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real(data))
    out = tmp_path / "out"
    with weights.WeightWriter(out) as writer:
        writer.export(model.graph, model.root, out / "prefill.onnx")
        writer.export(model.fresh().graph, model.root, out / "decode.onnx")
    assert max(hashed) <= 4096 and len(hashed) == 4  # head + tail samples of W1 and W2, once each
    assert os.path.getsize(out / "weights.bin") == 2 * W.nbytes
    for name in ("prefill", "decode"):
        got = execute.run(onnx.load(out / f"{name}.onnx", load_external_data=False), {"X": X}, root=out)["Y"]
        np.testing.assert_allclose(got, X @ W + X @ w2, rtol=1e-5, atol=1e-5)


def test_a_host_table_streamed_from_external_data_is_np_saves_bytes(tmp_path):
    """`write_host_tables` has the writer's copier copy an external fp32 weight into its .npy in the
    kernel; once the writer is closed the file is what np.save writes for the same values."""
    from mtkc.runtime.generate import WeightTable, _stream_npy, write_host_tables

    table = np.random.default_rng(0).standard_normal((37, 11)).astype(np.float32)
    node = oh.make_node("Gather", ["table", "ids"], ["y"])
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [3])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 11])],
                          [onnx.numpy_helper.from_array(np.zeros(5, np.float32), "pad"),
                           onnx.numpy_helper.from_array(table, "table")])
    onnx.save(oh.make_model(graph), str(tmp_path / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    model = mmodel.load(tmp_path / "m.onnx")
    const = next(t for t in model.graph.tensors().values() if t.name == "table")
    with weights.WeightWriter(tmp_path / "out") as writer:
        entries = write_host_tables(tmp_path / "out", {"embedding": WeightTable(const, model.values)}, writer)
        assert _stream_npy(WeightTable(const, model.values), tmp_path / "streamed.npy", writer)  # copied, not np.save
    np.save(tmp_path / "want.npy", table)
    assert (tmp_path / "out" / "host" / "embedding.npy").read_bytes() == (tmp_path / "want.npy").read_bytes()
    assert (tmp_path / "streamed.npy").read_bytes() == (tmp_path / "want.npy").read_bytes()
    assert entries == {"embedding": {"path": "host/embedding.npy", "dtype": "float32", "shape": [37, 11]}}
