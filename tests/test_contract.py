"""mtkc.contract: the one owner of the compiled graphs' I/O contract."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from mtkc.contract import cache, exporters, io, mask, positions


def test_the_mask_builder_is_the_causal_mask_of_every_former_copy():
    """What the Generator, kv-cache's map_feeds and attention's causal bias each built by hand."""
    t, c, k, value = 4, 6, 3, -7.0
    valid = np.array([1, 1, 0, 1, 0, 0], bool)
    built = mask.attention_mask(t, c, value, valid, np.arange(t) < k)[0, 0]
    by_hand = np.full((t, c + t), value, np.float32)  # Generator: valid slots, then causal real rows
    by_hand[:, :c][:, valid] = 0.0
    by_hand[:, c:][np.tril(np.ones((t, t), bool)) & (np.arange(t) < k)[None, :]] = 0.0
    assert np.array_equal(built, by_hand)
    empty = mask.attention_mask(t, c, value)[0, 0]  # kv-cache map_feeds: empty cache, causal new tokens
    assert (empty[:, :c] == value).all() and np.array_equal(empty[:, c:] == 0, np.tril(np.ones((t, t), bool)))
    past = 2  # attention's causal bias: key j visible to query i iff j <= i + past
    bias = mask.additive(t, t + past, value, offset=past)
    assert np.array_equal(bias == 0, np.arange(t + past)[None, :] <= np.arange(t)[:, None] + past)


def test_mask_value_default_and_option():
    assert mask.value_of({}) == mask.value_of({"mask_value": None}) == mask.DEFAULT_VALUE
    assert mask.value_of({"mask_value": -100}) == -100.0
    assert np.isfinite(np.float16(mask.DEFAULT_VALUE) * 2)  # fp16 headroom: score + value stays finite
    assert np.exp(np.float32(mask.DEFAULT_VALUE) + np.float32(1e4)) == 0.0  # outweighs scores of 1e4


@pytest.mark.parametrize("name, found", [
    ("past_key_values.3.key", ("past", "key", 3)),
    ("present.3.value", ("present", "value", 3)),
    ("past.0.key", ("past", "key", 0)),
    ("input.cache.layers.12.keys", ("past", "key", 12)),
    ("output.cache.layers.1.values", ("present", "value", 1)),
    ("past_value_7", ("past", "value", 7)),
    ("present_key_0", ("present", "key", 0)),
    ("input_ids", None),
    ("cache_0", None),
])
def test_every_exporter_cache_spelling_maps_onto_the_contract(name, found):
    assert exporters.recognise(name) == found
    assert exporters.contract_name(name) == (None if found is None else f"{found[0]}_{found[1]}_{found[2]}")


def test_unrecognised_cache_tensors_pair_by_position():
    names = ["input_ids", "attention_mask", "cache_0", "cache_1", "cache_2", "cache_3"]
    assert exporters.cache_entries(names, [2, 2, 4, 4, 4, 4], "past") == [
        ("cache_0", "key", 0), ("cache_1", "value", 0), ("cache_2", "key", 1), ("cache_3", "value", 1)]
    assert exporters.cache_entries(["present.1.key", "present.0.value", "present.0.key"], [4, 4, 4], "present") == [
        ("present.0.key", "key", 0), ("present.0.value", "value", 0), ("present.1.key", "key", 1)]


def test_io_names_and_order():
    assert io.past("key", 2) == "past_key_2" and io.past_of("present_value_2") == "past_value_2"
    assert io.past_of("logits") is None and io.cache_name("past_value_10") == ("past", "value", 10)
    names = ["past_value_1", "position_ids", "past_key_1", "past_key_0", "attention_mask", "input_ids"]
    assert sorted(names, key=io.order_key) == ["input_ids", "attention_mask", "position_ids", "past_key_0",
                                               "past_key_1", "past_value_1"]
    assert io.ort_dtype("tensor(int64)") == np.int64 and io.ort_dtype("tensor(string)") is None


def test_positions_of_a_padded_call():
    assert positions.of_call(5, 4, 2).tolist() == [5, 6, 6, 6]
    table = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
    rows = positions.rope_rows(table, np.array([4, 5]))
    assert rows.shape == (1, 2, 2, 3) and np.array_equal(rows[0, :, 1], table[:, 5])


def test_new_and_sliding_layouts():
    c, t = 6, 2
    valid = np.zeros(c, bool)
    past = np.zeros((1, 1, c, 1), np.float32)
    present = np.array([7, 8], np.float32).reshape(1, 1, t, 1)
    past = cache.store("new", past, present, filled=3, real=1)
    assert past[0, 0, :, 0].tolist() == [0, 0, 0, 7, 0, 0]
    assert cache.advance("new", valid, 3, t, 1).tolist() == [0, 0, 0, 1, 0, 0]
    assert cache.fits("new", valid, 5, t, 1) and not cache.fits("new", valid, 5, t, 2)
    slid = cache.advance("sliding", valid, 0, t, 1)
    assert slid.tolist() == [0, 0, 0, 0, 1, 0]
    assert cache.fits("sliding", slid, 1, t, 2) and not cache.fits("sliding", np.ones(c, bool), 1, t, 1)
    full = np.arange(c + t, dtype=np.float32).reshape(1, 1, c + t, 1)
    assert cache.from_outputs(full, "new", t, c)[0, 0, :, 0].tolist() == [6, 7]
    assert cache.from_outputs(full, "sliding", t, c).shape[2] == c


def test_the_contract_sits_low_in_the_layers():
    """It may import mtkc.errors, mtkc.ir and itself (plus numpy/onnx/stdlib), nothing above."""
    root = Path(__file__).resolve().parents[1] / "compiler" / "contract"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("mtkc"):
                    assert name.split(".")[1] in ("contract", "errors", "ir"), f"{path.name} imports {name}"


def test_a_compiled_manifest_follows_the_contract(exported, tmp_path):
    """Names, dtypes and order of every graph's I/O, and the recorded mask value and model digest."""
    from mtkc.backend.manifest import sha256
    from mtkc.pipeline.compile import compile_model

    model = exported("llama", "legacy17", cache=True)
    manifest = compile_model(model, "8.0", tmp_path / "out", {"seq_len": 4, "cache_len": 8, "chunks": 2,
                                                              "no_convert": True}).manifest
    for graph in manifest["graphs"]:
        for side in ("inputs", "outputs"):
            names = [t["name"] for t in graph[side]]
            assert names == sorted(names, key=io.order_key), (graph["name"], names)
            for t in graph[side]:
                assert t["name"] in io.DTYPES or io.cache_name(t["name"]), t["name"]
                assert np.dtype(t["dtype"]) == np.dtype(io.DTYPES.get(t["name"], np.float32)), t
    assert manifest["options"]["mask_value"] == mask.DEFAULT_VALUE
    assert manifest["options"]["mask_value_source"] == "default"
    assert manifest["model"]["sha256"] == sha256(model)
