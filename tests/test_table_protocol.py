"""`Context.table` is typed by the capability-table protocol; the null table stands in for an SDK
in pass unit tests and gives the passes that consult the table the same result as no table."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest

from mtkc.ir.model import load
from mtkc.passes import contrib, legalize, rmsnorm
from mtkc.rewrite.pass_api import Context
from mtkc.rewrite.table import CapabilityTable, NullTable
from mtkc.target.capability import load_table


def test_real_and_null_tables_satisfy_the_protocol():
    assert isinstance(load_table("8.0"), CapabilityTable) and isinstance(NullTable(), CapabilityTable)


def test_null_table_runs_standard_ops_only():
    table = NullTable()
    relu = gs.Node("Relu", inputs=[gs.Variable("x")], outputs=[gs.Variable("y")])
    fused = gs.Node("SkipSimplifiedLayerNormalization", domain="com.microsoft")
    assert table.supports(relu) and table.verdict(relu).supported
    assert not table.has_op("com.microsoft", "RotaryEmbedding") and not table.has_op("", "SimplifiedLayerNormalization")
    verdict = table.verdict(fused)
    assert (verdict.supported, verdict.target, verdict.reason) == (False, "cpu", "op-not-in-table")


@pytest.mark.parametrize("exporter", ["legacy17", "hf-ortfused"])
def test_passes_see_the_null_table_as_no_table(exported, exporter):
    path = exported("qwen2", exporter)
    original = [(n.domain, n.op) for n in load(path).graph.toposort().nodes]
    ops = []
    for table in (None, NullTable()):
        model = load(path)
        ctx = Context(table, {"seq_len": 8}, model.root, model.values)
        for p in (contrib.ContribOps(), rmsnorm.RMSNorm(), legalize.Legalize()):
            if p.applies(ctx):
                p.run(model.graph, ctx)
        ops.append([(n.domain, n.op) for n in model.graph.toposort().nodes])
    assert ops[0] == ops[1] and ops[0] != original  # the passes did rewrite, the same way
