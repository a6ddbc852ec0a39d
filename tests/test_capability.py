"""Capability tables: loading, validation, and every constraint kind on one-node graphs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from mtkc.errors import InputError
from mtkc.pipeline.registry import builtin_passes
from mtkc.target import capability
from mtkc.target.capability import Catalog, load_table

SDKS = ["6.0", "7.0", "8.0", "9.0"]
BUILTIN_PASSES = set(builtin_passes())  # every remedy must name a pass that exists
F, I64, I32, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL


def one_node(op, inputs, outputs, inits=(), domain="", opset=17, **attrs) -> gs.Node:
    """The single node of a graph built with onnx.helper: inputs/outputs are (name, type, shape);
    inits are numpy arrays keyed by name (become initializers, i.e. constants)."""
    inits = dict(inits)
    node = helper.make_node(op, [i[0] for i in inputs], [o[0] for o in outputs], domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(*i) for i in inputs if i[0] and i[0] not in inits],
        [helper.make_tensor_value_info(*o) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return gs.import_onnx(helper.make_model(graph, opset_imports=imports)).nodes[0]


def verdict(sdk, node, arch=None, opset=None):
    return load_table(sdk, arch).verdict(node, opset)


def add(a_shape, b_shape, out_shape, dtype=F, b_const=None):
    inits = {"b": b_const} if b_const is not None else {}
    return one_node("Add", [("a", dtype, a_shape), ("b", dtype, b_shape)], [("y", dtype, out_shape)], inits)


# ---- loading -------------------------------------------------------------------------------------


def test_available_sdks_and_extends_chain():
    assert capability.available_sdks() == SDKS
    t9 = load_table("9.0")
    assert (t9.version, t9.arch, t9.extends) == ("9.0", "mdla6.1", ("8.0", "7.0", "6.0"))
    assert t9.entry("", "Softmax") == load_table("6.0").entry("ai.onnx", "Softmax")  # inherited
    assert "A" in t9.sources and "F1907" in t9.sources and "F1907" not in load_table("8.0").sources
    assert load_table("6").version == "6.0" and load_table("np8").version == "8.0"
    assert set(load_table("6.0").archs) == {"mdla2.0", "mdla3.0"}  # archs are never inherited
    assert set(t9.archs) == {"mdla5.1", "mdla5.5", "mdla6.1"}


def test_native_rmsnorm_only_from_np8():
    for sdk in SDKS:
        expected = sdk in ("8.0", "9.0")
        for domain in ("ai.onnx", "com.microsoft"):  # onnxruntime runs it in the default domain
            assert load_table(sdk).has_op(domain, "SimplifiedLayerNormalization") is expected
            assert load_table(sdk).entry(domain, "SimplifiedLayerNormalization") is not None


def test_unknown_sdk_and_arch_list_the_available_ones():
    with pytest.raises(InputError, match=r"unknown SDK '5.1'; available: 6.0, 7.0, 8.0, 9.0"):
        load_table("5.1")
    with pytest.raises(InputError, match=r"unknown arch 'mdla6.1' for SDK 6.0; available: mdla2.0, mdla3.0"):
        load_table("6.0", "mdla6.1")


def test_every_entry_is_sourced_and_names_only_builtin_passes():
    for sdk in SDKS:
        t = load_table(sdk)
        assert t.notes and t.defaults["max_rank"] == 4 and "int64" not in t.defaults["dtypes"]
        for e in t.entries.values():
            assert e.provenance in capability.PROVENANCE
            assert all(s in t.sources for s in e.sources)
            if e.remedy:
                assert set(e.remedy.passes) <= BUILTIN_PASSES, (sdk, e.op_type)
        for r in t.remedies.values():
            assert set(r.passes) <= BUILTIN_PASSES


BASE = """
[sdk]
version = "1.0"
default_arch = "x1"
[archs.x1]
description = "test arch"
[sources]
S = "a source"
[defaults]
dtypes = ["float32"]
max_rank = 4
static_shapes = true
[ops."ai.onnx".Relu]
provenance = "documented"
sources = ["S"]
[ops."ai.onnx".MatMul]
provenance = "inferred"
const_inputs = [1]
"""


def catalog(tmp_path: Path, **files: str) -> Catalog:
    for name, text in files.items():
        (tmp_path / f"neuropilot-{name}.toml").write_text(text)
    return Catalog(tmp_path)


def test_extends_replaces_whole_entries_and_merges_sources(tmp_path):
    child = """
[sdk]
version = "2.0"
extends = "1.0"
default_arch = "x2"
[archs.x2]
[sources]
T = "another"
[ops."ai.onnx".MatMul]
provenance = "documented"
sources = ["S", "T"]
"""
    c = catalog(tmp_path, **{"1.0": BASE, "2.0": child})
    t = c.load("2")
    assert c.versions() == ["1.0", "2.0"] and t.extends == ("1.0",)
    assert t.entry("", "MatMul").constraints == {"dtypes": ["float32"], "max_rank": 4, "static_shapes": True}
    assert c.load("1.0").entry("", "MatMul").constraints["const_inputs"] == [1]
    assert t.has_op("ai.onnx", "Relu") and set(t.sources) == {"S", "T"}


@pytest.mark.parametrize("edit, message", [
    (('static_shapes = true\n[ops', 'static_shapes = true\nmax_rnk = 3\n[ops'),
     "neuropilot-1.0.toml: defaults.max_rnk: unknown key"),
    (('const_inputs = [1]', 'const_inputs = [1]\nbroadcst = "equal-rank"'),
     "neuropilot-1.0.toml: ops.ai.onnx.MatMul.broadcst: unknown key"),
    (('[sources]', '[colours]\n[sources]'), "neuropilot-1.0.toml: colours: unknown key"),
    (('const_inputs = [1]', 'const_inputs = [1'), "neuropilot-1.0.toml: malformed TOML"),
    (('sources = ["S"]', 'sources = ["Q"]'), "ops.ai.onnx.Relu.sources: unknown source id 'Q'"),
    (('provenance = "inferred"', 'provenance = "rumour"'), "ops.ai.onnx.MatMul.provenance: must be one of"),
    (('dtypes = ["float32"]', 'dtypes = ["float33"]'), "defaults.dtypes: unknown dtype 'float33'"),
    (('max_rank = 4', 'max_rank = "four"'), "defaults.max_rank: must be a non-negative integer"),
    (('const_inputs = [1]', 'supported = false\nconst_inputs = [1]'),
     "ops.ai.onnx.MatMul.const_inputs: constraints on an unsupported entry"),
    (('default_arch = "x1"', 'default_arch = "x9"'), "sdk.default_arch: 'x9' is not one of"),
    (('version = "1.0"', 'version = "1.1"'), "sdk.version: must be '1.0'"),
    (('const_inputs = [1]', 'host = { input = 0, rows = 3 }'), "ops.ai.onnx.MatMul.host.rows: unknown key"),
    (('const_inputs = [1]', 'broadcast = "numpy"'), "ops.ai.onnx.MatMul.broadcast: must be 'equal-rank' or 'any'"),
    (('[sources]', '[remedies.not-a-reason]\npasses = ["fold"]\n[sources]'), "remedies.not-a-reason: unknown reason"),
])
def test_malformed_table_is_an_input_error_naming_file_and_key(tmp_path, edit, message):
    c = catalog(tmp_path, **{"1.0": BASE.replace(*edit)})
    with pytest.raises(InputError) as err:
        c.load("1.0")
    assert message in str(err.value)


def test_extends_unknown_or_cyclic(tmp_path):
    a = BASE.replace('default_arch', 'extends = "2.0"\ndefault_arch')
    b = BASE.replace('version = "1.0"', 'version = "2.0"\nextends = "1.0"')
    with pytest.raises(InputError, match="sdk.extends: cycle"):
        catalog(tmp_path, **{"1.0": a, "2.0": b}).load("1.0")
    with pytest.raises(InputError, match="sdk.extends: unknown SDK '3.0'"):
        catalog(tmp_path, **{"1.0": BASE.replace('default_arch', 'extends = "3.0"\ndefault_arch')}).load("1.0")


# ---- constraint kinds ----------------------------------------------------------------------------


def test_dtypes_no_int64_anywhere():
    v = verdict("6.0", add([1, 4], [1, 4], [1, 4], dtype=I64))
    assert (v.supported, v.target, v.reason, v.detail) == (False, "cpu", "dtype-unsupported", "input 0 'a' is int64")
    assert v.passes == ("int64-to-int32",) and "int64-to-int32" in v.remedy
    assert verdict("6.0", add([1, 4], [1, 4], [1, 4], dtype=I32)).supported
    assert verdict("6.0", add([1, 4], [1, 4], [1, 4])).supported  # float32 under --relax-fp32


def test_input_dtypes_override_per_index(tmp_path):
    text = BASE + '[ops."ai.onnx".Gather]\nprovenance = "inferred"\ninput_dtypes = { "1" = ["int32"] }\n'
    t = catalog(tmp_path, **{"1.0": text}).load("1.0")
    inits = {"d": np.zeros((4, 2), np.float32)}
    ok = one_node("Gather", [("d", F, [4, 2]), ("i", I32, [3])], [("y", F, [3, 2])], inits)
    bad = one_node("Gather", [("d", F, [4, 2]), ("i", TensorProto.INT16, [3])], [("y", F, [3, 2])], inits)
    assert t.verdict(ok).supported
    assert (t.verdict(bad).reason, t.verdict(bad).detail) == ("dtype-unsupported", "input 1 'i' is int16")


def test_bool_mask_maths_is_flagged_on_every_sdk():
    where = one_node("Where", [("c", B, [1, 1, 4, 4]), ("x", F, [1, 1, 4, 4]), ("z", F, [1, 1, 4, 4])],
                     [("y", F, [1, 1, 4, 4])])
    less = one_node("Less", [("a", F, [1, 4]), ("b", F, [1, 4])], [("y", B, [1, 4])])
    for sdk in SDKS:
        for node, detail in ((where, "input 0 'c' is bool"), (less, "output 0 'y' is bool")):
            v = verdict(sdk, node)
            assert (v.reason, v.detail, v.passes) == ("dtype-unsupported", detail, ("mask",))
            assert load_table(sdk).has_op("", node.op)  # in the table; the bool dtype is what fails


def test_max_rank():
    v = verdict("8.0", add([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]))
    assert (v.reason, v.detail, v.passes) == ("rank-unsupported", "input 0 'a' has rank 5 > 4", ("rank4",))
    assert verdict("8.0", add([2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5])).supported


def test_static_shapes():
    v = verdict("6.0", add(["batch", 4], ["batch", 4], ["batch", 4]))
    assert (v.reason, v.detail) == ("shape-dynamic", "input 0 'a' has shape [batch, 4]")
    assert v.passes == ("bind-shapes", "fold") and "--seq-len" in v.remedy


def test_const_inputs():
    shape32 = {"s": np.array([2, 2], np.int32)}
    runtime = one_node("Reshape", [("x", F, [4]), ("s", I32, [2])], [("y", F, [2, 2])])
    const = one_node("Reshape", [("x", F, [4]), ("s", I32, [2])], [("y", F, [2, 2])], shape32)
    v = verdict("6.0", runtime)
    assert (v.reason, v.detail) == ("input-not-constant", "input 1 's' is computed at run time")
    assert verdict("6.0", const).supported
    int64 = one_node("Reshape", [("x", F, [4]), ("s", I64, [2])], [("y", F, [2, 2])],
                     {"s": np.array([2, 2], np.int64)})
    assert verdict("6.0", int64).supported  # int64 by the ONNX spec; the converter casts it


def test_int64_constants_must_fit_int32_and_runtime_int64_never():
    def slice_(ends, runtime=False):
        inputs = [("x", F, [1, 8]), ("s", I64, [1]), ("e", I64, [1]), ("a", I64, [1])]
        inits = {"s": np.array([4], np.int64), "a": np.array([1], np.int64)}
        if not runtime:
            inits["e"] = np.array([ends], np.int64)
        return one_node("Slice", inputs, [("y", F, [1, 4])], inits)

    assert verdict("6.0", slice_(8)).supported
    big = verdict("9.0", slice_(2**63 - 1))
    assert (big.reason, big.detail, big.passes) == (
        "dtype-unsupported", "input 2 'e' is a int64 constant with values outside int32 (9223372036854775807)",
        ("int64-to-int32",))
    runtime = verdict("9.0", slice_(8, runtime=True))
    assert (runtime.reason, runtime.detail) == ("dtype-unsupported", "input 2 'e' is int64")


def test_activation_matmul_follows_the_table(tmp_path):
    act = one_node("MatMul", [("q", F, [1, 2, 4, 8]), ("k", F, [1, 2, 8, 4])], [("y", F, [1, 2, 4, 4])])
    for sdk in SDKS:  # BATCH_MATMUL: adapter API since 5.1.2
        assert verdict(sdk, act).supported
    strict = catalog(tmp_path, **{"1.0": BASE}).load("1.0")  # a table whose MatMul needs a weight
    assert strict.verdict(act).reason == "input-not-constant"
    weight = one_node("MatMul", [("x", F, [1, 4, 8]), ("w", F, [8, 4])], [("y", F, [1, 4, 4])],
                      {"w": np.zeros((8, 4), np.float32)})
    assert strict.verdict(weight).supported


def test_attribute_allow_lists():
    shape = {"s": np.array([2, 2], np.int32)}
    zero = one_node("Reshape", [("x", F, [4]), ("s", I32, [2])], [("y", F, [2, 2])], shape, allowzero=1)
    v = verdict("6.0", zero)
    assert (v.reason, v.detail, v.passes) == ("attribute-unsupported", "attribute allowzero=1 not in [0]", ("opset17",))
    split18 = one_node("Split", [("x", F, [1, 4])], [("a", F, [1, 2]), ("b", F, [1, 2])], opset=18,
                       axis=1, num_outputs=2)
    assert (verdict("6.0", split18).detail, verdict("6.0", split18).passes) == (
        "attribute num_outputs is not supported", ("opset17",))
    gelu = one_node("Gelu", [("x", F, [1, 4])], [("y", F, [1, 4])], opset=20)
    gelu_tanh = one_node("Gelu", [("x", F, [1, 4])], [("y", F, [1, 4])], opset=20, approximate="tanh")
    assert verdict("8.0", gelu).detail == "attribute approximate='none' not in ['tanh']"  # schema default
    v8 = verdict("8.0", gelu_tanh)  # in the 8.0 table, but NPU partitions are opset 17, which has no Gelu
    assert (v8.reason, v8.detail) == ("no-opset17-form", "Gelu does not exist in opset 17; NPU partitions are opset 17")
    v6 = verdict("6.0", gelu_tanh)
    assert (v6.reason, v6.first_sdk) == ("op-not-in-table", None)


def test_arch_tightens_constraints():
    conv = one_node("Conv", [("x", F, [1, 4, 8, 8]), ("w", F, [4, 2, 3, 3])], [("y", F, [1, 4, 6, 6])],
                    {"w": np.zeros((4, 2, 3, 3), np.float32)}, group=2)
    assert verdict("6.0", conv, arch="mdla3.0").supported
    v = verdict("6.0", conv, arch="mdla2.0")
    assert (v.reason, v.detail) == ("attribute-unsupported", "attribute group=2 not in [1]")


def test_last_axis():
    def softmax(axis=None, opset=17):
        attrs = {} if axis is None else {"axis": axis}
        return one_node("Softmax", [("x", F, [1, 2, 4, 4])], [("y", F, [1, 2, 4, 4])], opset=opset, **attrs)

    assert verdict("6.0", softmax(-1)).supported and verdict("6.0", softmax(3)).supported
    assert verdict("6.0", softmax()).supported  # opset 13+ default axis = -1
    other = verdict("6.0", softmax(1))
    assert (other.detail, other.remedy) == ("axis=[1] is not the last axis (rank 4)", "CPU fallback")
    assert verdict("6.0", softmax(opset=11), opset=11).reason == "attribute-unsupported"  # default 1

    def mean(axes=None, attr=None, axes_const=True):
        inputs, inits = [("x", F, [1, 4, 8])], {}
        if axes is not None:
            inputs.append(("axes", I32, [len(axes)]))
            if axes_const:
                inits["axes"] = np.array(axes, np.int32)
        kw = {"axes": attr} if attr is not None else {}
        return one_node("ReduceMean", inputs, [("y", F, [1, 4, 1])], inits, opset=18 if attr is None else 17, **kw)

    assert verdict("6.0", mean(attr=[-1])).supported
    assert verdict("6.0", mean(axes=[2])).supported
    assert verdict("6.0", mean(axes=[1])).reason == "attribute-unsupported"
    assert verdict("6.0", mean()).detail.startswith("axes unset: reduces over all axes")
    assert verdict("6.0", mean(axes=[2], axes_const=False)).reason == "input-not-constant"
    rms = one_node("SimplifiedLayerNormalization", [("x", F, [1, 4, 8]), ("g", F, [8])], [("y", F, [1, 4, 8])],
                   {"g": np.ones(8, np.float32)}, domain="com.microsoft", epsilon=1e-6)
    assert verdict("8.0", rms).supported  # contrib op: default axis -1
    v = verdict("6.0", rms)
    assert (v.reason, v.passes, v.first_sdk) == ("op-unsupported", ("rmsnorm",), "8.0")


def test_broadcast_equal_rank():
    v = verdict("6.0", add([1, 4], [1, 4, 1], [1, 4, 4]))
    assert (v.reason, v.detail) == ("broadcast-unsupported", "inputs 'a' (rank 2) and 'b' (rank 3) differ in rank")
    assert verdict("6.0", add([1, 4, 8], [8], [1, 4, 8], b_const=np.ones(8, np.float32))).supported
    assert verdict("6.0", add([1, 4, 8], [1, 4, 8], [1, 4, 8])).supported
    higher = add([4, 8], [1, 4, 8], [1, 4, 8], b_const=np.ones((1, 4, 8), np.float32))
    assert verdict("6.0", higher).reason == "broadcast-unsupported"


def test_host_lookup_of_a_big_constant_table():
    def gather(rows):
        return one_node("Gather", [("emb", F, [rows, 16]), ("ids", I64, [1, 8])], [("y", F, [1, 8, 16])],
                        {"emb": np.zeros((rows, 16), np.float32)})

    for sdk in SDKS:
        v = verdict(sdk, gather(1000))
        assert (v.target, v.reason, v.passes) == ("host", "host-op", ("embedding",))
        assert "1000 rows (> 512)" in v.detail
    small = verdict("6.0", gather(100))
    assert (small.target, small.reason) == ("cpu", "dtype-unsupported")  # int64 ids, not a host lookup


def test_op_level_reasons_on_every_sdk():
    x = [("x", F, [1, 8])]
    cases = {
        ("Sin", ""): ("op-unsupported", ("rope",)),
        ("Cos", ""): ("op-unsupported", ("rope",)),
        ("Log", ""): ("op-unsupported", ()),
        ("Shape", ""): ("op-unsupported", ("bind-shapes", "fold")),
        ("Range", ""): ("op-unsupported", ("bind-shapes", "fold")),
        ("ConstantOfShape", ""): ("op-unsupported", ("bind-shapes", "fold")),
        ("NonZero", ""): ("op-unsupported", ("fold",)),
        ("MultiHeadAttention", "com.microsoft"): ("op-unsupported", ("attention",)),
        ("GroupQueryAttention", "com.microsoft"): ("op-unsupported", ("attention",)),
        ("Attention", ""): ("op-unsupported", ("attention",)),
        ("RotaryEmbedding", "com.microsoft"): ("op-unsupported", ("rope",)),
        ("HardSigmoid", ""): ("op-not-in-table", ()),
        ("Frobnicate", "com.example"): ("unknown-domain", ()),
    }
    for sdk in SDKS:
        for (op, domain), (reason, passes) in cases.items():
            node = gs.Node(op, name=f"n_{op}", domain=domain, inputs=[gs.Variable("x", np.float32, [1, 8])],
                           outputs=[gs.Variable("y", np.float32, [1, 8])])
            v = verdict(sdk, node)
            assert (v.reason, v.passes, v.first_sdk, v.target) == (reason, passes, None, "cpu"), (sdk, op)
    log = verdict("6.0", one_node("Log", x, x))
    assert log.remedy == "CPU fallback" and "not available" in log.detail


def test_remedy_marks_unregistered_passes_as_planned():
    known = frozenset({"rope"})
    assert capability.remedy_text(("no-such-pass", "rope"), "8.0", "a hint", known) == \
        "pass no-such-pass (planned); pass rope; --sdk 8.0; a hint"
    assert capability.remedy_text(("no-such-pass",), None) == "pass no-such-pass"  # no registry given: no marking
    assert capability.remedy_text((), None) == "CPU fallback"


def test_tables_import_no_pass_module():
    """The target layer sits below the passes: loading and judging never imports one."""
    code = ("import sys; from mtkc.target.capability import load_table; load_table('8.0'); "
            "print(sorted(m for m in sys.modules if m.startswith(('mtkc.passes', 'mtkc.manager', 'mtkc.rewrite'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
