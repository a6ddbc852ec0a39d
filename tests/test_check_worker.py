"""`check --jobs 2`: compile's graphs after the first built by a child process (`mtkc.pipeline.worker`).

The report is the in-process one, byte for byte, on exports from every exporter (with and without a
KV cache, one and two layer chunks, rope_mode open and given). When the child's answer cannot be
taken (another rope mode, a child that dies or prints garbage) the parent builds the graphs itself;
an error in a later graph is reported as it is in-process, after the child's log records.
"""

from __future__ import annotations

import json
import sys

import pytest

from mtkc import cli
from mtkc.interrupts import GROUPS
from mtkc.options import Options, of
from mtkc.pipeline import build as B
from mtkc.pipeline import worker as W
from mtkc.pipeline.check import check

CASES = [  # (family, exporter, cache, sdk, extra options)
    ("qwen2", "legacy14", True, "6.0", ()),
    ("qwen2", "legacy17", True, "8.0", ()),
    ("qwen2", "legacy17", True, "8.0", ("--chunks", "2", "--rope-mode", "pos_emb")),
    ("qwen2", "dynamo", True, "7.0", ()),
    ("qwen2", "hf", True, "6.0", ("--cache-io", "sliding")),
    ("qwen2", "optimum", True, "8.0", ()),
    ("qwen2", "genai-fp32", True, "8.0", ()),
    ("qwen2", "genai-int4", True, "6.0", ()),
    ("gemma2", "hf", True, "8.0", ()),
    ("llama", "legacy17", False, "8.0", ("--kv-cache",)),
    ("llama", "hf", False, "6.0", ()),  # one graph: no worker
]


@pytest.fixture
def built_here(monkeypatch):
    """The names of the graphs this process builds (a worker's are built in the child)."""
    names: list[str] = []
    original = B.build_graph

    def spy(model, name, *args, **kwargs):
        names.append(name)
        return original(model, name, *args, **kwargs)

    monkeypatch.setattr(B, "build_graph", spy)
    return names


def run(capsys, model, sdk, *extra) -> tuple[int, str, str]:
    code = cli.main(["check", str(model), "--sdk", sdk, "--seq-len", "8", "--cache-len", "32", "--format", "json",
                     *map(str, extra)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("family,exporter,cache,sdk,extra", CASES,
                         ids=["-".join([c[0], c[1], "cache" if c[2] else "nocache", c[3], *c[4]]) for c in CASES])
def test_two_jobs_report_the_same_bytes(capsys, exported, built_here, family, exporter, cache, sdk, extra):
    model = exported(family, exporter, cache=cache)
    alone = run(capsys, model, sdk, *extra, "--jobs", "1")
    graphs = [g["name"] for g in json.loads(alone[1])["graphs"]]
    assert built_here == graphs
    built_here.clear()
    assert run(capsys, model, sdk, *extra, "--jobs", "2") == alone
    assert built_here == graphs[:1]  # the child's answer was taken
    assert not GROUPS  # and the child is reaped


def test_the_parent_builds_what_the_child_cannot_give(capsys, exported, built_here, monkeypatch):
    """Another rope mode than the first graph's, a child that dies, one that prints garbage or JSON
    that is no answer: the same report, every graph built here."""
    model = exported("qwen2", "legacy17", cache=True)
    alone = run(capsys, model, "8.0", "--jobs", "1")
    collect = W.Worker.collect
    children = {
        "other mode": None,
        "dies": [sys.executable, "-c", "import sys; sys.exit(3)"],
        "garbage": [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"graphs\": ')"],
        "not an answer": [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"graphs\": [{}]}')"],
    }
    for why, command in children.items():
        if command is None:
            monkeypatch.setattr(W.Worker, "collect", lambda self, mode: collect(self, "no such mode"))
        else:
            monkeypatch.setattr(W.Worker, "collect", collect)
            monkeypatch.setattr(W, "COMMAND", command)
        built_here.clear()
        assert run(capsys, model, "8.0", "--jobs", "2") == alone, why
        assert built_here == ["prefill", "decode"], why
        assert not GROUPS


def test_an_error_in_a_later_graph_is_reported_after_its_records(capsys, exported, monkeypatch):
    """The child's records replayed in order, then its error: compile would stop, the raw verdicts stand."""
    model = exported("qwen2", "legacy17", cache=True)
    script = ("import logging, sys; from mtkc.pipeline import worker as W\n"
              "def answer(job, records):\n"
              "    real = W._fingerprint(W.Path(job['model']), len(W.load(job['model']).graph.nodes))\n"
              "    logging.getLogger('mtkc.passes').warning('mtkc: decode says so')\n"
              "    return {'fingerprint': real, 'graphs': [], 'error': {'type': 'PassError', 'message': 'decode broke'}}\n"
              "W._answer = answer\nsys.exit(W.main())\n")
    monkeypatch.setattr(W, "COMMAND", [sys.executable, "-c", script])
    code, out, err = run(capsys, model, "8.0", "--jobs", "2")
    assert code == 0
    assert err.index("mtkc: decode says so") < err.index("mtkc: compile would stop: decode broke")
    report = json.loads(out)
    assert report["graphs"] == [] and report["unsupported"]


def test_no_worker_where_it_cannot_pay_or_would_run_user_code(exported, tmp_path):
    """Auto on a tiny graph, `jobs` 1, no later graph, a plugin or a pass that is not built in: none."""
    model = exported("qwen2", "legacy17", cache=True)
    from mtkc.ir.model import load
    from mtkc.target import capability

    m, table = load(model), capability.load_table("8.0")
    rest = [B.plan_variants(m.graph, of({"seq_len": 8}))[1]]
    assert W.Worker.start(m, of({"seq_len": 8}), rest, table, jobs=None) is None  # a tiny graph
    assert W.Worker.start(m, of({"seq_len": 8}), rest, table, jobs=1) is None
    assert W.Worker.start(m, of({"seq_len": 8}), [], table, jobs=2) is None
    plugin = tmp_path / "p.py"
    plugin.write_text("")
    assert W.Worker.start(m, of({"seq_len": 8}).replace(plugins=(str(plugin),)), rest, table, jobs=2) is None
    entry_point = of({"seq_len": 8}).replace(passes=("bind-shapes", "an-entry-point"))
    assert W.Worker.start(m, entry_point, rest, table, jobs=2) is None
    started = W.Worker.start(m, of({"seq_len": 8}), rest, table, jobs=2)
    started.close()
    assert not GROUPS and started.proc.returncode is not None


def test_options_survive_json():
    options = of({"seq_len": 8, "cache_len": 32, "input_shapes": {"input_ids": [1, 8]}, "skip_passes": ["fold"],
                  "force_cpu": ["op:Softmax"], "mask_value": -1e9, "rope_mode": "pos_emb", "chunks": 2,
                  "pass_options": {"mine": {"k": 1.5, "on": True, "name": "x"}}})
    assert Options.from_json(json.loads(json.dumps(options.to_json()))) == options
    assert Options.from_json(json.loads(json.dumps(Options().to_json()))) == Options()


def test_the_api_takes_jobs(exported):
    model = exported("qwen2", "legacy17", cache=True)
    one, two = (check(model, "8.0", {"seq_len": 8}, jobs=j).to_json() for j in (1, 2))
    assert one == two and [g["name"] for g in one["graphs"]] == ["prefill", "decode"]
