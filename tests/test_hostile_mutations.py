"""Hypothesis campaign: mutate valid small models (delete or retype fields, swap dtypes, break
references, bend shapes) and compile them. mtkc must answer 0 (and then the graphs run: the
compile's own run check) or 2 with one line; never a traceback, never exit 4. The same for
what mtkc reads back (OUT folders, prompt files), below."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_kit import (assert_contract, calibrate_by_hand, make_model, make_tokenizer, run_cli, save, snapshot, tiny,
                         with_cpu_node)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from mtkc.pipeline.calibrate import save_npz


def _constant_model() -> onnx.ModelProto:
    c = helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(np.ones((1, 4), np.float32)))
    return make_model([c, helper.make_node("Add", ["x", "c"], ["s"], name="add"),
                       helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1)],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])


SEEDS = [tiny, lambda: with_cpu_node("hm"), _constant_model]
DTYPES = [0, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.BOOL,
          TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.INT4, 99]
OPS = ["Relu", "MatMul", "Add", "Softmax", "Cast", "Gather", "Reshape", "Hardmax", "NoSuchOp", ""]
ATTR_TYPES = [onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT, onnx.AttributeProto.STRING,
              onnx.AttributeProto.TENSOR, onnx.AttributeProto.INTS, onnx.AttributeProto.GRAPH, 0]


def _mutate(model: onnx.ModelProto, kind: str, pick: int, value: int) -> None:
    g = model.graph
    nodes = list(g.node)
    node = nodes[pick % len(nodes)]
    if kind == "drop-node-input" and node.input:
        del node.input[pick % len(node.input)]
    elif kind == "drop-node-output" and node.output:
        del node.output[pick % len(node.output)]
    elif kind == "drop-node":
        g.node.remove(node)
    elif kind == "drop-initializer" and g.initializer:
        del g.initializer[pick % len(g.initializer)]
    elif kind == "drop-graph-input" and g.input:
        del g.input[pick % len(g.input)]
    elif kind == "drop-graph-output" and g.output:
        del g.output[pick % len(g.output)]
    elif kind == "drop-opset":
        del model.opset_import[:]
    elif kind == "drop-elem-type" and g.input:
        g.input[0].type.tensor_type.ClearField("elem_type")
    elif kind == "retype-initializer" and g.initializer:
        g.initializer[pick % len(g.initializer)].data_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-graph-input" and g.input:
        g.input[0].type.tensor_type.elem_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-graph-output" and g.output:
        g.output[0].type.tensor_type.elem_type = DTYPES[value % len(DTYPES)]
    elif kind == "retype-attribute" and node.attribute:
        node.attribute[pick % len(node.attribute)].type = ATTR_TYPES[value % len(ATTR_TYPES)]
    elif kind == "add-attribute":
        node.attribute.append(helper.make_attribute(["axis", "to", "perm", "value"][value % 4], [value, -value]))
    elif kind == "swap-op":
        node.op_type = OPS[value % len(OPS)]
    elif kind == "break-input-reference" and node.input:
        node.input[pick % len(node.input)] = f"nowhere_{value}"
    elif kind == "rename-initializer" and g.initializer:
        g.initializer[pick % len(g.initializer)].name = f"renamed_{value}"
    elif kind == "duplicate-output-name" and len(nodes) > 1 and node.output and nodes[(pick + 1) % len(nodes)].output:
        nodes[(pick + 1) % len(nodes)].output[0] = node.output[0]
    elif kind == "bend-input-shape" and g.input and g.input[0].type.tensor_type.shape.dim:
        dims = g.input[0].type.tensor_type.shape.dim
        dims[pick % len(dims)].dim_value = [0, -1, 2**40, 3, 1][value % 5]
    elif kind == "bend-initializer-dims" and g.initializer:
        t = g.initializer[pick % len(g.initializer)]
        t.dims[:] = [[], [0], [-3], [2, 2], [2**31]][value % 5]
    elif kind == "self-loop" and node.output:
        node.input.append(node.output[0])
    elif kind == "opset-version" and model.opset_import:
        model.opset_import[0].version = [1, 6, 7, 13, 18, 21, 10**6][value % 7]


KINDS = ["drop-node-input", "drop-node-output", "drop-node", "drop-initializer", "drop-graph-input",
         "drop-graph-output", "drop-opset", "drop-elem-type", "retype-initializer", "retype-graph-input",
         "retype-graph-output", "retype-attribute", "add-attribute", "swap-op", "break-input-reference",
         "rename-initializer", "duplicate-output-name", "bend-input-shape", "bend-initializer-dims", "self-loop",
         "opset-version"]
LIMIT = 120  # seconds per compile of a tiny model: a hang is a failure naming the mutations
MUTATIONS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 99)), min_size=1, max_size=3)


def _compile_mutated(seed: int, mutations) -> None:
    model = SEEDS[seed]()
    for kind, pick, value in mutations:
        if model.graph.node:
            _mutate(model, kind, pick, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        try:
            path.write_bytes(model.SerializeToString())
        except Exception:  # protobuf itself refuses to serialise it: nothing to feed mtkc
            return
        def too_slow(signum, frame):
            raise AssertionError(f"compile of a mutated model took over {LIMIT} s: {mutations}")

        previous = signal.signal(signal.SIGALRM, too_slow)
        signal.alarm(LIMIT)
        try:
            r = run_cli(["compile", path, "--sdk", "8.0", "-o", Path(tmp) / "out", "--no-convert"])
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert r.code in (0, 2), (mutations, r.err)
        assert_contract(r, r.code)
        if r.code == 2:
            assert not (Path(tmp) / "out").exists()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEEDS) - 1), MUTATIONS)
@example(0, [("retype-graph-input", 0, DTYPES.index(TensorProto.BFLOAT16))])  # numpy has no name for it
def test_mutated_models_exit_0_or_2(seed, mutations):
    _compile_mutated(seed, mutations)


def test_a_bfloat16_input_beside_float32_is_named_as_the_mix(tmp_path):
    model = tiny()
    _mutate(model, "retype-graph-input", 0, DTYPES.index(TensorProto.BFLOAT16))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    r = run_cli(["compile", path, "--sdk", "8.0", "-o", tmp_path / "out", "--no-convert"])
    assert r.code == 2 and "mixes bfloat16 and float32 inputs" in r.err, r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEEDS) - 1), MUTATIONS)
def test_mutated_models_exit_0_or_2_long(seed, mutations):
    _compile_mutated(seed, mutations)


# ------------------------------------------------------------------ OUT folders and prompt files (issue 22)
#
# The same contract for what mtkc reads back: a calibrated OUT (manifest, calibration index, ranges,
# samples) mutated, then `convert --quant` (every sample is checked) and, under -m slow, also
# `verify --quant`; prompt files mutated, then read by `generate`. Exit 0 or 2 with one line, never a
# traceback or exit 4, no file outside the example's folder, no command injected.

MARK = "PWNED"
VALUES = [None, 0, -1, 2**63, 1.5e308, True, "", "../../escape", "/etc/passwd", f"a\nb;touch {MARK}", "calibration",
          "calibration/index.json", [], {}, [[[[[]]]]], "x" * 300, {"name": "x"}, [1, 2**40], "float16"]
JSON_ACTIONS = ["delete", "replace", "duplicate"]
SAMPLE_ACTIONS = ["truncate", "flip", "retype", "reshape", "drop-key", "add-key", "nan", "symlink", "folder", "float16"]
TARGETS = ["manifest.json", "calibration/index.json", "calibration/ranges.json", "sample"]


def _paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _mutate_json(data, pick: int, action: str, value: int):
    """`data` with one node deleted, replaced by a hostile value, or a list element duplicated."""
    paths = list(_paths(data))
    path = paths[pick % len(paths)]
    if not path:
        return copy.deepcopy(VALUES[value % len(VALUES)]) if action == "replace" else data
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "delete":
        del parent[key]
    elif action == "replace":
        parent[key] = copy.deepcopy(VALUES[value % len(VALUES)])
    elif action == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    return data


def _mutate_sample(path: Path, action: str, value: int) -> None:
    try:  # an earlier mutation may have broken it: then only byte-level edits apply
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    except Exception:
        arrays = {}
    if not arrays and action not in ("truncate", "flip", "symlink", "folder"):
        return
    name = sorted(arrays)[value % len(arrays)] if arrays else ""
    if action == "truncate":
        path.write_bytes(path.read_bytes()[: value * 7])
    elif action == "flip":
        raw = bytearray(path.read_bytes())
        if raw:
            raw[(value * 37) % len(raw)] ^= 0xFF
            path.write_bytes(bytes(raw))
    elif action == "retype":
        save_npz(path, {**arrays, name: arrays[name].astype([np.int64, np.float64, np.bool_, np.int8][value % 4])})
    elif action == "reshape":
        save_npz(path, {**arrays, name: arrays[name].reshape(-1)})
    elif action == "drop-key":
        save_npz(path, {k: v for k, v in arrays.items() if k != name})
    elif action == "add-key":
        save_npz(path, {**arrays, f"extra{value}": np.zeros(2)})
    elif action == "nan":
        save_npz(path, {**arrays, name: np.full_like(arrays[name], [np.nan, np.inf, -np.inf][value % 3])})
    elif action == "symlink":
        path.unlink()
        path.symlink_to(["/etc/passwd", "/dev/zero", "../../escape.npz"][value % 3])
    elif action == "folder":
        path.unlink()
        path.mkdir()
    elif action == "float16":  # what quantscale stores for a float32 input: accepted
        save_npz(path, {**arrays, name: arrays[name].astype(np.float16)})


@pytest.fixture(scope="module")
def calibrated_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mut-out")
    model = save(with_cpu_node("hm"), root / "src" / "m.onnx")
    r = run_cli(["compile", model, "--sdk", "8.0", "-o", root / "out", "--no-convert"])
    assert_contract(r, 0)
    calibrate_by_hand(root / "out")
    return root / "out"


def _mutate_out(out: Path, mutations) -> None:
    for target, action, pick, value in mutations:
        if target == "sample":
            samples = sorted(p for p in (out / "calibration").rglob("*.npz") if p.is_file() and not p.is_symlink())
            if samples:
                _mutate_sample(samples[pick % len(samples)], SAMPLE_ACTIONS[value % len(SAMPLE_ACTIONS)], value)
            continue
        path = out / target
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        path.write_text(json.dumps(_mutate_json(data, pick, action, value)))


def _check_out_mutation(base: Path, mutations, commands) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = root / "case" / "out"
        shutil.copytree(base, out, symlinks=True)
        _mutate_out(out, mutations)
        before = snapshot(root, skip=root / "case")
        for command in commands:
            r = run_cli([command[0], out, *command[1:]], cwd=root / "case")
            assert r.code in command_codes(command[0]), (mutations, r.err)
            assert_contract(r, r.code)
            if r.code == 2:
                assert r.out == "", (mutations, r.out)
        assert snapshot(root, skip=root / "case") == before, mutations
        assert not list(root.rglob(MARK)), mutations


def command_codes(command: str) -> tuple[int, ...]:
    return {"convert": (0, 2), "verify": (0, 1, 2)}[command]


OUT_MUTATIONS = st.lists(st.tuples(st.sampled_from(TARGETS), st.sampled_from(JSON_ACTIONS), st.integers(0, 400),
                                   st.integers(0, 99)), min_size=1, max_size=3)
CONVERT = [("convert", "--quant", "A16W8", "--no-convert")]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(OUT_MUTATIONS)
def test_mutated_out_folders_exit_0_or_2(calibrated_out, mutations):
    _check_out_mutation(calibrated_out, mutations, CONVERT)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(OUT_MUTATIONS)
def test_mutated_out_folders_exit_0_or_2_long(calibrated_out, mutations):
    _check_out_mutation(calibrated_out, mutations, CONVERT + [("verify", "--quant", "A16W8", "--new-tokens", "1")])


SEED_PROMPTS = [b'{"ids": [5, 6, 7]}\n{"text": "t5 t6"}\n', b"t5 t6 t7\n\nt8 t9\n", b'{"ids": [1]}\n']
PROMPT_EDITS = ["bom", "insert", "delete", "nul", "byte", "surrogate", "digits", "nest", "nan", "join", "truncate",
                "crlf", "brace"]


def _mutate_prompts(data: bytes, edit: str, pick: int, value: int) -> bytes:
    at = pick % (len(data) + 1)
    insert = {"bom": b"\xef\xbb\xbf", "nul": b"\0", "byte": bytes([0x80 + value % 128]), "surrogate": b"\\ud83d",
              "digits": b"9" * (value * 60), "nest": b"[" * (value * 20), "nan": b"NaN", "crlf": b"\r\n",
              "brace": b"{", "insert": b'"ids": [' if value % 2 else b"}"}
    if edit == "bom":
        return insert["bom"] + data
    if edit == "delete":
        return data[:at] + data[at + 1 + value % 5:]
    if edit == "join":
        return data.replace(b"\n", b" ", 1)
    if edit == "truncate":
        return data[:at]
    return data[:at] + insert[edit] + data[at:]


@pytest.fixture(scope="module")
def prompt_tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("mut-tok"), "{% for m in messages %}t7 {{ m['content'] }}{% endfor %}")


def _check_prompt_mutation(out: Path, tokenizer: Path, seed: int, edits, chat: bool) -> None:
    data = SEED_PROMPTS[seed]
    for edit, pick, value in edits:
        data = _mutate_prompts(data, edit, pick, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("p.jsonl" if seed == 0 else "p.txt")
        path.write_bytes(data)
        r = run_cli(["generate", out, "--prompts", path, "--tokenizer", tokenizer, "--max-new-tokens", "1",
                     *(["--chat-template"] if chat else [])], cwd=Path(tmp))
        assert r.code in (0, 2), (edits, r.err)
        assert_contract(r, r.code)
        if r.code == 2:
            assert r.out == "" and (str(path) in r.err or "graph 'model'" in r.err), (edits, r.err)
        assert sorted(os.listdir(tmp)) == [path.name] and not (Path.cwd() / MARK).exists()


PROMPT_MUTATIONS = st.lists(st.tuples(st.sampled_from(PROMPT_EDITS), st.integers(0, 200), st.integers(0, 99)),
                            min_size=1, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEED_PROMPTS) - 1), PROMPT_MUTATIONS, st.booleans())
def test_mutated_prompt_files_exit_0_or_2(calibrated_out, prompt_tokenizer, seed, edits, chat):
    _check_prompt_mutation(calibrated_out, prompt_tokenizer, seed, edits, chat)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(SEED_PROMPTS) - 1), PROMPT_MUTATIONS, st.booleans())
def test_mutated_prompt_files_exit_0_or_2_long(calibrated_out, prompt_tokenizer, seed, edits, chat):
    _check_prompt_mutation(calibrated_out, prompt_tokenizer, seed, edits, chat)


@pytest.mark.parametrize("key", ["sdk", "arch"])
def test_a_manifest_sdk_or_arch_that_is_no_string_is_exit_2(calibrated_out, tmp_path, key):
    """Found by the mutation test above: `"arch": []` reached the SDK table's cache as a key (exit 4)."""
    out = tmp_path / "out"
    shutil.copytree(calibrated_out, out, symlinks=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest[key] = []
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli(["convert", out, "--quant", "A16W8", "--no-convert"])
    assert_contract(r, 2, f"manifest.json: {key}: not a string")


NODE = object()  # stands for a node name the graph has
DECODER_EDITS = [
    (None, "decoder: missing (compiled by an mtkc without decoder layer records)"),
    ([], 'expected {"layers": [...], "lm_head"}'),
    ({"layers": [{"index": "1", "nodes": []}]}, "layer index '1': expected 0.."),
    ({"layers": [{"index": True, "nodes": []}]}, "layer index 'True'"),
    ({"layers": [{"index": -1, "nodes": []}]}, "layer index '-1'"),
    ({"layers": [{"index": 2**40, "nodes": []}]}, "layer index '1099511627776'"),
    ({"layers": [{"index": 0, "nodes": []}, {"index": 0, "nodes": []}]}, "layer 0 listed twice"),
    ({"layers": [{"index": 0, "nodes": "abc"}]}, "layer 0: nodes not a list"),
    ({"layers": [{"index": 0, "nodes": ["nowhere"]}]}, "unit 0: node 'nowhere' is in none of the graph's partitions"),
    ({"layers": [{"index": 0, "nodes": [NODE]}, {"index": 1, "nodes": [NODE]}]}, "is in units 0 and 1"),
    ({"layers": [{"index": 0, "nodes": [], "output": 7}]}, "layer 0: output not a string"),
    ({"layers": [], "lm_head": ["x"]}, "unit lm_head: node \"['x']\" is in none"),
]


@pytest.mark.parametrize("decoder,says", DECODER_EDITS)
def test_a_bad_decoder_layer_record_is_exit_2(calibrated_out, tmp_path, decoder, says):
    """graphs[].decoder (the quantisation units compile found) read back as untrusted: one line, exit 2."""
    out = tmp_path / "out"
    shutil.copytree(calibrated_out, out, symlinks=True)
    manifest = json.loads((out / "manifest.json").read_text())
    node = manifest["graphs"][0]["partitions"][0]["nodes"][0]
    if decoder is None:
        del manifest["graphs"][0]["decoder"]
    else:
        text = json.dumps(decoder, default=lambda _: node)
        manifest["graphs"][0]["decoder"] = json.loads(text)
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli(["verify", out, "--quant", "A16W8", "--new-tokens", "1"])
    assert_contract(r, 2, says)
