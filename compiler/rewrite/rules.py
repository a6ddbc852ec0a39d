"""Rewrite rules and the one driver that applies them.

A rule is four things (a class with these members):

    anchor   op types the driver indexes ("Softmax", "com.microsoft::QuickGelu"); every node of
             one of them is a candidate site, reported as a miss when it is not rewritten
    pattern  the subgraph (built with `op.<Type>(...)`, see `mtkc.rewrite.builder`), rooted at a
             `root` op type within `steps` consumers downstream of the anchor (`near`); no
             pattern: the anchor node alone is the site (`m["node"]`)
    check    further conditions; raises `Refused(reason, offending node or tensor)`
    rewrite  emits the replacement with the same builder and returns [(old tensor, new tensor)]

plus `done(ctx, m)`: the site is already in the target form (counted as a site, not rewritten:
this makes a rule idempotent). The driver owns the rest: traversal in graph order, one miss per
refused anchor with the first failing condition (what `--explain` prints), sites covered by an
earlier match, matching each site only when the walk reaches it (after the earlier rewrites, so a
binding is never stale), replacement (`replace_uses`; an emitted tensor takes the replaced one's dtype
and shape), rollback of the nodes a refused rewrite had emitted, counting, a note with the
number of sites, and dead-node cleanup after each rule. Order and names are restored by the pass
manager. A refusal is always `Refused`, raised by a pattern condition, `check` or `rewrite`.

    class DropDropout(Rule):
        anchor = ("Dropout",)
        def check(self, ctx, m):
            if len(m["node"].outputs) > 1 and m["node"].outputs[1].outputs:
                raise Refused("the Dropout mask is used", m["node"])
        def rewrite(self, op, ctx, m):
            node = m["node"]
            return [(node.outputs[0], op.Identity(node.inputs[0]))]

    @register
    class DropDropoutPass(RulePass):
        name = "drop-dropout"
        rules = (DropDropout(),)
"""

from __future__ import annotations

from typing import Iterator, Sequence

import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import cleanup, replace_uses
from mtkc.rewrite.builder import PATTERN, Builder, Emit
from mtkc.rewrite.pass_api import Context, Miss, Pass, PassResult
from mtkc.rewrite.pattern import Match, Pattern, Refused, near


class Rule:
    anchor: tuple[str, ...] = ()
    root: str | None = None  # op type of the pattern's root (default: the anchor's op type)
    steps: int = 0  # how many consumers downstream of the anchor the root may be
    sites: str = ""  # what a site is, for the note "N <sites> sites" (default: the class name)
    quiet: bool = False  # anchors the pattern does not match are not misses (another rule reports them)

    def applies(self, ctx: Context) -> bool:
        """Whether the rule runs at all (an option, the table)."""
        return True

    def candidate(self, node: gs.Node) -> bool:
        """Whether an anchor node is a candidate site at all (a non-candidate is no miss)."""
        return True

    def pattern(self, op: Builder) -> Pattern | None:
        """Built once per rule class, with the pattern builder."""
        return None

    def start(self, graph: gs.Graph, ctx: Context) -> None:
        """Called before the anchors are visited (graph-wide analysis, e.g. one evaluation for all sites)."""

    def check(self, ctx: Context, m: Match) -> None:
        """Raise Refused when the matched site must not be rewritten."""

    def done(self, ctx: Context, m: Match) -> bool:
        return False

    def rewrite(self, op: Emit, ctx: Context, m: Match) -> list[tuple[gs.Tensor, gs.Tensor]]:
        raise NotImplementedError

    def finish(self, graph: gs.Graph, ctx: Context, result: PassResult) -> None:
        """Called once after the rewrites (graph-wide follow-up: I/O changes)."""

    def prefix(self, m: Match) -> str:
        """Emitted nodes are named after this (the site's root node)."""
        return m.nodes[0].name


class RulePass(Pass):
    """A pass made of rules, applied in order by the driver."""

    rules: Sequence[Rule] = ()

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        result = PassResult()
        for rule in self.rules:
            apply(rule, graph, ctx, result)
        return result


def _anchored(rule: Rule, node: gs.Node) -> bool:
    domain = node.domain or ""
    return (node.op if domain in ("", "ai.onnx") else f"{domain}::{node.op}") in rule.anchor


def _pattern(rule: Rule) -> Pattern | None:
    cls = type(rule)
    if "_compiled" not in vars(cls):
        cls._compiled = rule.pattern(PATTERN)
    return cls._compiled


def _miss(anchor: gs.Node, why: Refused) -> Miss:
    return Miss(anchor.name, why.reason if why.where is None else f"{why.reason} (at {why.where})")


def _sites(rule: Rule, graph: gs.Graph, ctx: Context) -> Iterator[tuple[gs.Node, Match | Refused]]:
    """Each candidate anchor in graph order with its site (matched and checked) or its refusal.

    Lazy: a site is matched when it is reached, so a caller that rewrites between two steps has
    the next site bound to the graph as it is then (on a chain f(f(x)) the second site reads the
    first one's replacement, not the tensor it replaced).
    """
    rule.start(graph, ctx)
    pattern, read, covered = _pattern(rule), ctx.read_values, set()
    for node in list(graph.nodes):
        if not _anchored(rule, node) or id(node) in covered or not node.outputs or not rule.candidate(node):
            continue
        if pattern is None:
            m = Match(True, {"node": node}, [node], read=read)
        else:
            m = near(pattern, node, rule.root or node.op, rule.steps, read)
        m.anchor, m.graph = node, graph
        if not m and rule.quiet:
            continue
        try:
            if not m:
                raise Refused(m.reason, m.node)
            rule.check(ctx, m)
        except Refused as why:
            yield node, why
            continue
        covered.update(id(n) for n in m.nodes)
        yield node, m


def find(rule: Rule, graph: gs.Graph, ctx: Context | None = None) -> tuple[list[Match], list[Miss]]:
    """The sites of `rule` (matched and checked) and a miss for every other anchor; changes nothing."""
    sites, misses = [], []
    for node, found in _sites(rule, graph, ctx or Context(None)):
        (misses.append(_miss(node, found)) if isinstance(found, Refused) else sites.append(found))
    return sites, misses


def apply(rule: Rule, graph: gs.Graph, ctx: Context, result: PassResult) -> int:
    """Rewrite every site of `rule` as the walk reaches it; adds rewrites, misses and a note to `result`."""
    if not rule.applies(ctx):
        return 0
    sites = rewrites = 0
    for node, m in _sites(rule, graph, ctx):
        if isinstance(m, Refused):
            result.misses.append(_miss(node, m))
            continue
        sites += 1
        if rule.done(ctx, m):
            continue
        mark = len(graph.nodes)
        try:
            replaced = rule.rewrite(Emit(graph, rule.prefix(m)), ctx, m)
        except Refused as why:
            _rollback(graph, mark)
            result.misses.append(_miss(node, why))
            continue
        emitted = {id(t) for n in graph.nodes[mark:] for t in n.outputs}
        for old, new in replaced:
            if id(new) in emitted:
                new.dtype = old.dtype or new.dtype
                new.shape = old.shape if old.shape is not None else new.shape
            replace_uses(graph, old, new)
        rewrites += 1
    result.rewrites += rewrites
    result.notes.append(f"{sites} {rule.sites or type(rule).__name__} sites")
    if rewrites:
        cleanup(graph)
    rule.finish(graph, ctx, result)
    return rewrites


def _rollback(graph: gs.Graph, mark: int) -> None:
    """Remove the nodes appended after `mark`, unhooking them from the tensors they read."""
    for node in graph.nodes[mark:]:
        node.inputs.clear()
        node.outputs.clear()
    del graph.nodes[mark:]
