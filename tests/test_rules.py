"""The rewrite-rule layer: one builder for patterns and emitted nodes, the driver, README's plugin."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.execute import run
from mtkc.rewrite.builder import PATTERN, Emit
from mtkc.rewrite.pass_api import Context, PassResult
from mtkc.rewrite.pattern import Const, Refused, Var, match
from mtkc.rewrite.rules import Rule, apply, find

README = Path(__file__).resolve().parents[1] / "README.md"


def _graph():
    """y = (x * 2) / x2 twice over, built with the emitting builder."""
    x = gs.Variable("x", np.float32, [2, 3])
    graph = gs.Graph([], [x], [], opset=17)
    op = Emit(graph, "g")
    y = op.Div(op.Mul(x, op.const("two", np.array(2.0, np.float32))), op.Sqrt(x), _shape=[2, 3])
    z = op.Div(y, op.const("four", np.array(4.0, np.float32)), _shape=[2, 3])
    graph.outputs = [z]
    return graph, x


class ScaleByConstant(Rule):
    """Div(Mul(x, a), d) with d a constant -> Mul(x, a / d); refused for a runtime divisor."""

    anchor = ("Div",)

    def pattern(self, op):
        return op.Div(op.Mul(Var("x"), Const("a")), Var("d"), _name="div")

    def check(self, ctx, m):
        if not isinstance(m["d"], gs.Constant):
            raise Refused("divisor is computed at run time", m["d"])

    def rewrite(self, op, ctx, m):
        a = float(m.value("a").reshape(-1)[0]) / float(m["d"].values.reshape(-1)[0])
        return [(m["div"].outputs[0], op.Mul(m["x"], op.scalar("scale", a, m["x"])))]


def test_one_builder_matches_what_it_emits():
    graph, x = _graph()
    m = match(ScaleByConstant().pattern(PATTERN), graph.nodes[2].outputs[0])
    assert m and m["x"] is x and float(m.value("a").reshape(-1)[0]) == 2.0 and m["div"] is graph.nodes[2]


def test_driver_rewrites_records_refusals_and_is_idempotent():
    graph, x = _graph()
    feeds = {"x": np.random.default_rng(0).uniform(1, 2, (2, 3)).astype(np.float32)}
    want = run(graph, feeds)[graph.outputs[0].name]
    result = PassResult()
    assert apply(ScaleByConstant(), graph, Context(None), result) == 0
    assert [(m.node, m.reason) for m in result.misses] == \
        [("g/mtkc_div", "divisor is computed at run time (at g/mtkc_sqrt_out)"),
         ("g/mtkc_div/1", "expected Mul, found Div (at g/mtkc_div)")]
    assert result.notes == ["0 ScaleByConstant sites"]
    sites, misses = find(ScaleByConstant(), graph)
    assert (sites, len(misses)) == ([], 2)  # finding changes nothing
    np.testing.assert_allclose(run(graph, feeds)[graph.outputs[0].name], want, rtol=1e-6)


class RefusesLate(Rule):
    """A rewrite that emits nodes, then refuses: the driver removes what it emitted."""

    anchor = ("Sqrt",)

    def rewrite(self, op, ctx, m):
        op.Mul(m["node"].inputs[0], m["node"].inputs[0])
        raise Refused("changed its mind")


def test_a_refused_rewrite_leaves_the_graph_as_it_was():
    graph, x = _graph()
    before = [(n.name, [t.name for t in n.inputs]) for n in graph.nodes]
    consumers = len(x.outputs)
    result = PassResult()
    assert apply(RefusesLate(), graph, Context(None), result) == 0
    assert [(m.node, m.reason) for m in result.misses] == [("g/mtkc_sqrt", "changed its mind")]
    assert [(n.name, [t.name for t in n.inputs]) for n in graph.nodes] == before and len(x.outputs) == consumers


class SqrtToPow(Rule):
    anchor = ("Sqrt",)

    def done(self, ctx, m):
        return m["node"].inputs[0].name == "skip"

    def rewrite(self, op, ctx, m):
        node = m["node"]
        return [(node.outputs[0], op.Pow(node.inputs[0], op.scalar("half", 0.5, node.inputs[0])))]


def test_anchor_rules_count_sites_and_rewrites():
    graph, x = _graph()
    feeds = {"x": np.random.default_rng(1).uniform(1, 2, (2, 3)).astype(np.float32)}
    want = run(graph, feeds)[graph.outputs[0].name]
    result = PassResult()
    assert apply(SqrtToPow(), graph, Context(None), result) == 1
    assert "Sqrt" not in {n.op for n in graph.nodes} and result.notes == ["1 SqrtToPow sites"]
    np.testing.assert_allclose(run(graph, feeds)[graph.outputs[0].name], want, rtol=1e-6)
    assert apply(SqrtToPow(), graph, Context(None), PassResult()) == 0


def _readme_plugin() -> str:
    section = README.read_text().split("## Writing a plugin pass", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_plugin_rewrites_and_explains_its_refusals(exported, run_cli, tmp_path):
    plugin = tmp_path / "my_rules.py"
    plugin.write_text(_readme_plugin())
    model = exported("qwen2", "legacy17", False)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli("compile", model, "--sdk", "6.0", "-o", out, "--no-convert", "--seq-len", "8",
                                   "--plugin", plugin, "--explain", "div-to-reciprocal")
    assert code == 0, stderr
    text = stdout + stderr
    counts = re.search(r"div-to-reciprocal: (\d+) rewrites, (\d+) misses", text)
    assert counts and (int(counts[1]), int(counts[2])) == (5, 4), text  # the README's numbers
    assert text.count("integer division (int64) has no reciprocal (at ") == 4
    code, stdout, stderr = run_cli("verify", out)
    assert code == 0, stdout + stderr


class SiluToQuickGelu(Rule):
    """x * Sigmoid(x) -> com.microsoft QuickGelu(x, alpha=1) (the plugin rule of the chain test)."""

    anchor, root, steps = ("Sigmoid",), "Mul", 1

    def pattern(self, op):
        x = Var("x")
        return op.Mul(x, op.Sigmoid(x), _name="mul")

    def rewrite(self, op, ctx, m):
        return [(m["mul"].outputs[0], op.QuickGelu(m["x"], alpha=1.0, _domain="com.microsoft"))]


def test_a_chain_of_sites_rewrites_each_site_once_and_resurrects_nothing():
    """f(f(x)): the second site is bound after the first rewrite, so it reads the first QuickGelu."""
    x = gs.Variable("x", np.float32, [2, 3])
    graph = gs.Graph([], [x], [], opset=17)
    op = Emit(graph, "g")
    y = x
    for _ in range(3):
        y = op.Mul(y, op.Sigmoid(y, _shape=[2, 3]), _shape=[2, 3])
    graph.outputs = [y]
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)}
    want = run(graph, feeds)[y.name]
    result = PassResult()
    assert apply(SiluToQuickGelu(), graph, Context(None), result) == 3
    assert [n.op for n in graph.toposort().nodes] == ["QuickGelu"] * 3
    assert graph.nodes[0].inputs[0] is x and all(a.outputs[0] is b.inputs[0] for a, b in zip(graph.nodes, graph.nodes[1:]))
    assert result.notes == ["3 SiluToQuickGelu sites"] and not result.misses
    np.testing.assert_allclose(run(graph, feeds)[graph.outputs[0].name], want, rtol=1e-5, atol=1e-6)
