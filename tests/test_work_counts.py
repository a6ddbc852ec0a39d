"""What compile, check, verify and generate cost in their dominant steps, on the tiny Qwen2 KV export
at SDK 7.0 (prefill + decode; its 640-row cos/sin table is a host Gather there, so pos_emb is picked).

Before (main at 5386010): compile imported the graph 4 times, ran the pipeline 3 times (the other
rope_mode by a full re-run), shape inference 15 times and opened 10 onnxruntime sessions; check
the same minus the run-check's 4 sessions. Before 81009cb every bind-shapes also ran onnxruntime's
symbolic shape inference (the TorchScript export's Range/Slice/Expand operands). Before 2026-12-03
fold re-inferred a fully typed graph and rope/rmsnorm left their new tensors untyped (one more
inference each): 7-9 per compile, now 5. Before 2026-12-03 (a6e867c) each later graph was imported
again from the parsed file (3 imports; now 1 and 2 copies), int64-to-int32 re-inferred the whole graph
(5 inferences per compile; now 3), and the run-check kept every session open.
"""

from __future__ import annotations

import json

import pytest

from mtkc.ir.counts import COUNTS
from mtkc.pipeline import verify as V
from mtkc.pipeline.check import check
from mtkc.pipeline.compile import compile_model
from mtkc.runtime.generate import generate
from mtkc.runtime.sessions import Sessions

SDK = "7.0"


@pytest.fixture(scope="module")
def kv_model(exported):
    return exported("qwen2", "legacy17", cache=True)


def test_compile_runs_the_pipeline_once_per_graph_written(kv_model, tmp_path):
    COUNTS.clear()
    result = compile_model(kv_model, SDK, tmp_path / "out", {"no_convert": True})
    graphs = [g["name"] for g in result.manifest["graphs"]]
    files = len(graphs) + sum(len(g["partitions"]) for g in result.manifest["graphs"])
    assert graphs == ["prefill", "decode"] and result.manifest["options"]["rope_mode"] == "pos_emb"
    assert result.build.picked["rope_mode"].startswith("pos_emb: the table Gather is a host lookup on SDK 7.0")
    assert (COUNTS["graph imports"], COUNTS["graph copies"]) == (1, 2)  # the input; copies for its verdicts and decode
    assert COUNTS["pipeline runs"] == 2
    assert COUNTS["shape inferences"] == 1 + len(graphs)  # the input's; per graph bind-shapes
    assert COUNTS["retypes"] == len(graphs)  # int64-to-int32 re-infers only downstream of its edits
    assert COUNTS["symbolic shape inferences"] == 0  # the shape operands' values type the bound graph (shape_values)
    # per graph one constant-folding batch, one rope-table evaluation and one mask-window probe (the
    # export's mask subgraph, run once); the run-check loads each file once
    assert COUNTS["sessions"] == 3 * len(graphs) + files
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["options"]["rope_mode"] == "pos_emb"


def test_the_run_check_holds_one_session_at_a_time(kv_model, tmp_path, monkeypatch):
    """Each written file's session is dropped after its run: compile's peak memory is its build's."""
    held, real = [], Sessions._open
    monkeypatch.setattr(Sessions, "_open", lambda self, path: held.append(len(self._sessions)) or real(self, path))
    result = compile_model(kv_model, SDK, tmp_path / "out", {"no_convert": True})
    files = sum(1 + len(g["partitions"]) for g in result.manifest["graphs"])
    assert held == [0] * files


def test_check_shares_compiles_build_and_runs_nothing_written(kv_model):
    COUNTS.clear()
    report = check(kv_model, SDK)
    assert [g.name for g in report.graphs] == ["prefill", "decode"] and report.picked["rope_mode"].startswith("pos_emb")
    assert (COUNTS["graph imports"], COUNTS["graph copies"], COUNTS["pipeline runs"]) == (1, 2, 2)
    assert COUNTS["sessions"] == 6  # fold, rope tables, mask window per graph
    assert COUNTS["shape inferences"] == 3 and COUNTS["symbolic shape inferences"] == 0


def test_verify_and_generate_build_each_session_once(kv_model, tmp_path):
    """verify: the original's session serves every prompt and sample, each compiled file one session
    for every step; generate: one session per graph for the prompt's chunks and every decode step."""
    out = tmp_path / "out"
    result = compile_model(kv_model, SDK, out, {"no_convert": True, "seq_len": 8, "cache_len": 64})
    files = sum(1 + len(g["partitions"]) for g in result.manifest["graphs"])
    COUNTS.clear()
    checked = V.verify(out, samples=3)
    assert checked.ok and len(checked.generations) == 2 and COUNTS["sessions"] == 1 + files
    COUNTS.clear()
    tokens = generate(out, list(range(1, 11)), 12)  # 10 tokens: two prefill chunks of T=8, then decode steps
    assert len(tokens) == 12 and COUNTS["sessions"] == len(result.manifest["graphs"])
