"""`mtkc calibrate`: every NPU partition's inputs on real prompts, stored so they feed the partition.

One tiny Qwen2 KV-cache compile (T=8, C=64) calibrated once with 10 prompts of 2..20 tokens and
3 decode steps (one stored per prompt, the default); the checks run on what it wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import tracemalloc

import numpy as np
import pytest

from mtkc.backend.calibration_data import read_sample
from mtkc.pipeline.calibrate import Running, calibrate, plan, sample_bytes, stored
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.graphs import load_session
from mtkc.runtime.prompts import Prompt
from mtkc.runtime.sessions import Sessions

T, C, DECODE = 8, 64, 3
PROMPTS = [[(7 * k + 3 * j) % 997 + 3 for j in range(n)] for k, n in enumerate((2, 5, 8, 9, 13, 16, 17, 20, 3, 11))]


@pytest.fixture(scope="module")
def out(exported, tmp_path_factory):
    folder = tmp_path_factory.mktemp("calib") / "out"
    compile_model(exported("qwen2", "legacy17", True), "8.0", folder, {"seq_len": T, "cache_len": C, "kv_cache": True})
    calibrate(folder, [Prompt(p) for p in PROMPTS], DECODE)
    return folder


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def _npu(out):
    return [(g, p) for g in _manifest(out)["graphs"] for p in g["partitions"] if p["target"] == "npu"]


def test_samples_feed_each_npu_partition_with_finite_outputs(out):
    parts = _npu(out)
    assert {g["name"] for g, _ in parts} == {"prefill", "decode"}
    for graph, part in parts:
        files = sorted((out / "calibration" / f"{graph['name']}.{part['id']}").glob("*.npz"))
        expected = sum(-(-len(p) // T) for p in PROMPTS) if graph["name"] == "prefill" else len(PROMPTS)
        assert len(files) == expected
        session = load_session(out / part["path"])
        names = [o.name for o in session.get_outputs()]
        for f in files[:: max(1, len(files) // 6)]:
            with np.load(f) as data:
                assert sorted(data.files) == sorted(i["name"] for i in part["inputs"])
                assert {data[i["name"]].dtype.name for i in part["inputs"] if i["dtype"] == "float32"} == {"float16"}
            feed = read_sample(f, part["inputs"])
            assert {k: v.dtype.name for k, v in feed.items()} == {i["name"]: i["dtype"] for i in part["inputs"]}
            for value in session.run(names, feed):
                assert np.isfinite(value).all(), f.name


def test_resident_weights_run_as_the_mapped_ones(out):
    """calibrate's sessions hold one private copy of weights.bin (no file mapping to be evicted under
    pressure), and a partition gives the mapped sessions' outputs bit for bit."""
    graph, part = _npu(out)[0]
    feed = read_sample(sorted((out / "calibration" / f"{graph['name']}.{part['id']}").glob("*.npz"))[0], part["inputs"])
    results = {}
    for resident in (False, True):
        sessions = Sessions(out, resident=resident)
        session = sessions.get(out / part["path"])
        results[resident] = session.run([o.name for o in session.get_outputs()], feed)
        assert {type(m) is np.memmap for m in sessions._maps.values()} == {not resident}
    assert all(np.array_equal(a, b) for a, b in zip(results[False], results[True]))


def test_decode_samples_carry_a_filling_cache(out):
    index = json.loads((out / "calibration" / "index.json").read_text())
    decode = [s for s in index["samples"] if s["graph"] == "decode"]
    assert len(decode) == len(PROMPTS) and index["decode_samples"] == 1 and index["float32_as"] == "float16"
    assert {s["step"] for s in decode} == set(range(DECODE))  # one step per prompt, every step across prompts
    for sample in decode:
        with np.load(out / "calibration" / sample["dir"] / sample["file"]) as data:
            visible = int((data["attention_mask"][0, 0, 0, :C] == 0).sum())  # cache slots the token attends
            assert visible == len(PROMPTS[sample["prompt"]]) + sample["step"]
            assert np.abs(data["past_key_0"]).sum() > 0 and np.abs(data["past_value_1"]).sum() > 0


def test_ranges_bound_every_sample(out):
    ranges = json.loads((out / "calibration" / "ranges.json").read_text())
    index = json.loads((out / "calibration" / "index.json").read_text())
    for sample in index["samples"]:
        with np.load(out / "calibration" / sample["dir"] / sample["file"]) as data:
            for key in data.files:
                r = ranges[sample["dir"]][key]
                low, high = np.array([r["min"], r["max"]], data[key].dtype)  # rounding is monotonic
                assert low <= data[key].min() and data[key].max() <= high
                assert r["min"] <= r["p1"] <= r["p50"] <= r["p99"] <= r["max"]


def test_histogram_percentiles_within_half_a_bin_and_memory_bounded():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(20000) * 3, rng.exponential(50, 5000), np.zeros(1000)])
    running = Running()
    for chunk in np.array_split(rng.permutation(values), 7):
        running.add(chunk.astype(np.float32))
    qs = (0.1, 1.0, 50.0, 99.0, 99.9)
    for got, want in zip(running.percentiles(qs), np.percentile(values, qs)):
        assert abs(got - want) <= 0.012 * abs(want) + 0.05, (got, want)  # half a bin, plus sampling
    assert running.min == float(values.astype(np.float32).min()) and running.max == float(values.astype(np.float32).max())
    assert running.counts.nbytes < 64 << 10 and running.counts.sum() == values.size


def test_float32_stored_as_float16_only_when_every_value_fits():
    small = np.array([1.5, -65504.0, 3e-3], np.float32)
    assert stored(small).dtype == np.float16 and np.allclose(stored(small), small, rtol=1e-3)
    assert stored(np.array([70000.0], np.float32)).dtype == np.float32
    assert stored(np.array([1, 2], np.int32)).dtype == np.int32


def test_heap_flat_in_the_number_of_prompts(out, tmp_path):
    """Python's heap peak (numpy arrays included) while calibrating 3 and 12 prompts: only the index grows."""
    peaks = {}
    for n in (3, 12):
        copy = tmp_path / f"c{n}"
        shutil.copytree(out, copy)
        tracemalloc.start()
        calibrate(copy, [Prompt(p) for p in (PROMPTS * 2)[:n]], DECODE)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[12] - peaks[3] < 256 << 10, peaks  # a float64 subsample per sample grew ~75 KB per sample


def test_announced_bytes_bound_what_is_written(out, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    manifest = _manifest(copy)
    expected = plan(manifest, [Prompt(p) for p in PROMPTS], T, DECODE, 1)
    entry = calibrate(copy, [Prompt(p) for p in PROMPTS], DECODE, max_bytes=expected.bytes)
    written = sum(f.stat().st_size for f in (copy / "calibration").rglob("*.npz"))
    assert entry["bytes"] == written <= expected.bytes
    assert expected.samples == entry["samples"]
    parts = {f"{g['name']}.{p['id']}": p for g, p in _npu(copy)}
    assert all(f.stat().st_size <= sample_bytes(parts[f.parent.name]) for f in (copy / "calibration").rglob("*.npz"))


def test_manifest_records_calibration_and_rerun_is_byte_identical(out, tmp_path):
    entry = _manifest(out)["calibration"]
    assert entry["path"] == "calibration" and entry["prompts"] == len(PROMPTS) and entry["decode_steps"] == DECODE
    assert entry["samples"] == {"decode.npu0": len(PROMPTS), "prefill.npu0": sum(-(-len(p) // T) for p in PROMPTS)}
    assert entry["bytes"] == sum(f.stat().st_size for f in (out / "calibration").rglob("*.npz"))
    copy = tmp_path / "again"
    shutil.copytree(out, copy)
    calibrate(copy, [Prompt(p) for p in PROMPTS], DECODE)

    def digest(folder):
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    assert digest(copy / "calibration") == digest(out / "calibration")
    assert (copy / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()


def test_cli_prints_disk_warns_and_refuses_past_max_bytes(out, tmp_path, run_cli):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(",".join(map(str, p)) for p in PROMPTS[:3]) + "\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": p}) + "\n" for p in PROMPTS[:3]))
    before = (out / "calibration" / "index.json").read_bytes()
    code, _, err = run_cli("calibrate", out, "--prompts", jsonl, "--max-bytes", 1000)
    assert code == 2 and "more than --max-bytes 1000" in err and "Traceback" not in err
    assert (out / "calibration" / "index.json").read_bytes() == before  # nothing written
    code, _, err = run_cli("calibrate", out, "--prompts", prompts)  # plain lines are text: need a tokenizer
    assert code == 2 and "needs --tokenizer" in err and "Traceback" not in err
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    code, stdout, err = run_cli("calibrate", copy, "--prompts", jsonl, "--decode-steps", 1, "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["samples"] == {"decode.npu0": 3, "prefill.npu0": 3}
    assert "MiB on disk" in err and "fewer than 200" in err and "decode.npu0 has 3" in err
    assert "--decode-steps 1 runs 1 decode call(s) per prompt" in err and "calibrated 3 prompt(s) in" in err
    code, stdout, err = run_cli("calibrate", copy, "--prompts", jsonl, "--decode-steps", 4, "--decode-samples", 2)
    assert code == 0, err
    assert "decode.npu0: 6 samples" in stdout and "2 stored per prompt" in stdout and " s)" in stdout


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_on_a_terminal(out, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    calibrate(copy, [Prompt(p) for p in PROMPTS[:3]], 1)
    drawn = terminal.getvalue()
    line = drawn.find("\r\x1b[Kmtkc: calibrate 3/3 prompts")
    assert line >= 0 and drawn.rfind("\r\x1b[K") > line  # drawn, then erased (whatever else stderr got)
