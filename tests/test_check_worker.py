"""`check --jobs 2`: the input's raw verdicts and compile's graphs after the first made by forked
children (`mtkc.pipeline.worker`).

The report is the in-process one, byte for byte, on exports from every exporter (with and without a
KV cache, one and two layer chunks, rope_mode open and given). When a child's answer cannot be
taken (another rope mode, a child that dies or writes garbage) the parent does its work itself;
an error in a later graph is reported as it is in-process, after the child's log records, and an
error in the raw verdicts before them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading

import pytest

from mtkc import cli
from mtkc.interrupts import GROUPS
from mtkc.errors import InputError, PassError
from mtkc.options import of
from mtkc.pipeline import build as B
from mtkc.pipeline import check as C
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


@pytest.fixture(autouse=True)
def alone(request, monkeypatch):
    """check as the CLI runs it, in a process with no thread of its own: earlier tests in this
    process may have left some (tqdm's monitor), which would keep check from forking
    (`test_no_fork_beside_a_host_program_s_threads` tests that)."""
    if "host_threads" not in request.keywords:
        monkeypatch.setattr(W, "_other_threads", lambda: [])


@pytest.fixture
def built_here(monkeypatch):
    """The names of the graphs this process builds, and "raw" each time it judges the input (a
    child's work happens in the child, where the spy's list is the child's copy)."""
    names: list[str] = []
    build_graph, raw_assessment = B.build_graph, C.raw_assessment

    def spy(model, name, *args, **kwargs):
        names.append(name)
        return build_graph(model, name, *args, **kwargs)

    def raw_spy(*args, **kwargs):
        names.append("raw")
        return raw_assessment(*args, **kwargs)

    monkeypatch.setattr(B, "build_graph", spy)
    monkeypatch.setattr(C, "raw_assessment", raw_spy)
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
    assert built_here == ["raw", *graphs]
    built_here.clear()
    assert run(capsys, model, sdk, *extra, "--jobs", "2") == alone
    assert built_here == graphs[:1]  # the children's answers were taken
    assert not GROUPS  # and the children are reaped


def test_the_parent_does_what_a_child_cannot_give(capsys, exported, built_here, monkeypatch):
    """Another rope mode than the first graph's, children that die, write garbage or JSON that is no
    answer: the same report, the input judged and every graph built here."""
    model = exported("qwen2", "legacy17", cache=True)
    alone = run(capsys, model, "8.0", "--jobs", "1")
    collect, reply = W.Worker.collect, W._reply
    children = {
        "other mode": lambda pipe, answer: reply(pipe, answer),
        "dies": lambda pipe, answer: os._exit(3),
        "garbage": lambda pipe, answer: os.write(pipe, b'{"result": '),
        "not an answer": lambda pipe, answer: reply(pipe, {**answer, "result": [{}] if isinstance(answer["result"], list) else {}}),
    }
    for why, child in children.items():
        monkeypatch.setattr(W.Worker, "collect", (lambda self, mode: collect(self, "no such mode")) if why == "other mode"
                            else collect)
        monkeypatch.setattr(W, "_reply", child)
        built_here.clear()
        assert run(capsys, model, "8.0", "--jobs", "2") == alone, why
        assert built_here == (["prefill", "decode"] if why == "other mode" else ["prefill", "raw", "decode"]), why
        assert not GROUPS


def test_an_error_in_a_later_graph_is_reported_after_its_records(capsys, exported, monkeypatch):
    """The child's records replayed in order, then its error: compile would stop, the raw verdicts stand."""
    model = exported("qwen2", "legacy17", cache=True)

    def broken(*args, **kwargs):  # the child's build_graph: the parent's is build's own
        logging.getLogger("mtkc.passes").warning("mtkc: decode says so")
        raise PassError("decode broke")

    monkeypatch.setattr(W, "build_graph", broken)
    code, out, err = run(capsys, model, "8.0", "--jobs", "2")
    assert code == 0
    assert err.index("mtkc: decode says so") < err.index("mtkc: compile would stop: decode broke")
    report = json.loads(out)
    assert report["graphs"] == [] and report["unsupported"]


def test_an_error_in_the_raw_verdicts_comes_before_the_later_graphs(capsys, exported, monkeypatch):
    """As in one process, where the input is judged first: its error ends check, no later graph's record shows."""
    model = exported("qwen2", "legacy17", cache=True)

    def noisy(*args, **kwargs):
        logging.getLogger("mtkc.passes").warning("mtkc: decode says so")
        raise PassError("decode broke")

    def refused(*args, **kwargs):
        raise InputError("the input is refused")

    monkeypatch.setattr(W, "build_graph", noisy)
    monkeypatch.setattr(W, "raw_assessment", refused)
    code, out, err = run(capsys, model, "8.0", "--jobs", "2")
    assert (code, out) == (2, "") and "the input is refused" in err and "decode says so" not in err
    assert not GROUPS


def test_a_bad_input_fails_alike_in_one_process_and_with_children(capsys, exported):
    model = exported("qwen2", "legacy17", cache=True)
    alone = run(capsys, model, "8.0", "--input-shape", "nosuch=1,8", "--jobs", "1")
    assert alone[0] == 2 and "nosuch" in alone[2]
    assert run(capsys, model, "8.0", "--input-shape", "nosuch=1,8", "--jobs", "2") == alone


def test_no_child_where_it_cannot_pay_or_would_run_user_code(exported, tmp_path):
    """Auto on a tiny graph, `jobs` 1; no later graph, a plugin or a pass that is not built in: none
    builds later graphs."""
    model = exported("qwen2", "legacy17", cache=True)
    from mtkc.ir.model import load
    from mtkc.target import capability

    m, table = load(model), capability.load_table("8.0")
    rest = [B.plan_variants(m.graph, of({"seq_len": 8}))[1]]
    assert not W.wanted(m, None) and not W.wanted(m, 1) and W.wanted(m, 2)  # a tiny graph
    assert W.Worker.later(m, of({"seq_len": 8}), [], table) is None
    plugin = tmp_path / "p.py"
    plugin.write_text("")
    assert W.Worker.later(m, of({"seq_len": 8}).replace(plugins=(str(plugin),)), rest, table) is None
    entry_point = of({"seq_len": 8}).replace(passes=("bind-shapes", "an-entry-point"))
    assert W.Worker.later(m, entry_point, rest, table) is None
    started = W.Worker.later(m, of({"seq_len": 8}), rest, table)
    started.close()
    assert not GROUPS
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(started.pid, 0)


@pytest.mark.host_threads
def test_no_fork_beside_a_host_program_s_threads(exported):
    """A fork copies the locks other threads hold: with one running, check stays in one process."""
    from mtkc.ir.model import load

    m, stop = load(exported("qwen2", "legacy17", cache=True)), threading.Event()
    before = W._other_threads()  # what earlier tests in this process left running
    host = threading.Thread(target=stop.wait, name="host-pool")
    host.start()
    try:
        assert W._other_threads() == [*before, "host-pool"] and not W.wanted(m, 2)
    finally:
        stop.set()
        host.join()
    assert W._other_threads() == before and W.wanted(m, 2) == (not before)


def test_a_fork_the_system_refuses_leaves_the_work_here(capsys, exported, built_here, monkeypatch):
    model = exported("qwen2", "legacy17", cache=True)
    alone = run(capsys, model, "8.0", "--jobs", "1")

    def refused():
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(W.os, "fork", refused)
    built_here.clear()
    assert run(capsys, model, "8.0", "--jobs", "2") == alone
    assert built_here == ["raw", "prefill", "decode"]
    assert not GROUPS


def test_the_api_takes_jobs(exported):
    model = exported("qwen2", "legacy17", cache=True)
    one, two = (check(model, "8.0", {"seq_len": 8}, jobs=j).to_json() for j in (1, 2))
    assert one == two and [g["name"] for g in one["graphs"]] == ["prefill", "decode"]


@pytest.mark.parametrize("sdk", ["6.0", "8.0"])
def test_the_raw_verdicts_survive_json(exported, sdk):
    """What the raw child sends is what the parent gets back, down to the passes the table knows."""
    from mtkc.ir.model import load
    from mtkc.target import capability

    table = capability.load_table(sdk)
    raw, _ = B.raw_assessment(load(exported("qwen2", "legacy14", cache=True)), table, of({"seq_len": 8}))
    assert raw.groups
    first = raw.groups[0]  # a table that lists passes mtkc lacks (the remedy says "planned")
    first.verdict = dataclasses.replace(first.verdict, known_passes=frozenset({"rope", "fold"}))
    back = W.Assessment.from_json(json.loads(json.dumps(raw.to_json())))
    assert back == raw
    assert [g.verdict.known_passes for g in back.groups] == [g.verdict.known_passes for g in raw.groups]
