"""A small declarative subgraph matcher over graphsurgeon graphs, with reasons for misses.

A pattern is written as the ops it is made of, matched upward from the tensor it produces, with
the same builder that emits replacement nodes (`mtkc.rewrite.builder`: `op.Mul(a, b)`):

    x = Var("x")
    square = Or(op.Pow(x, Const(value=2.0)), op.Mul(x, x))
    pattern = op.ReduceMean(square, ...)

* `Op(type, *inputs, attrs=..., name=...)` (what `op.<type>(...)` builds): a node of that type whose inputs match, in order;
  `Add`/`Mul`/`Max`/`Min`/`And`/`Or` with two inputs also match with the inputs swapped.
* `Var(name)`: any tensor; the same name must bind the same tensor (so `Mul(x, x)` means square).
* `Const(name, value=, check=)`: a constant (initializer or `Constant` node), optionally with a value.
* Conditions (`check=` of Var, Const and Op) raise `Refused(reason)`; the reason becomes the miss.
* `Or(*alternatives)`, `Opt(type, inner)` (an optional op such as a Cast around `inner`).

`match(pattern, tensor)` returns a `Match`: on success its bindings (`m["x"]`, `m.value("eps")`)
and the nodes it covers; on failure the first failing condition and the node it failed on. Among
alternatives the failure that got furthest is kept (the best partial match), which is what
`mtkc compile --explain PASS` prints. `near(pattern, anchor)` tries the pattern on every tensor a
few steps downstream of an anchor node, so a pass can report one miss per candidate site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.constants import SMALL, close, constant_of, elements, values

COMMUTATIVE = {"Add", "Mul", "Max", "Min", "And", "Or", "Equal", "Sum"}


class Refused(Exception):
    """Why a candidate site is not rewritten: the one way a condition, check or rewrite says no.

    `at` is the offending node or tensor (or its name); the driver records it as a `Miss`.
    """

    def __init__(self, reason: str, at: gs.Node | gs.Tensor | str | None = None):
        super().__init__(reason)
        self.reason, self.at = reason, at

    @property
    def where(self) -> str | None:
        return self.at if isinstance(self.at, str) or self.at is None else self.at.name


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None


@dataclass
class Match:
    """Outcome of one match: bindings and covered nodes, or the first failing condition."""

    ok: bool
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: list[gs.Node] = field(default_factory=list)
    reason: str = ""
    node: str = ""
    depth: int = 0
    read: Callable[[gs.Constant], Any] | None = None
    anchor: gs.Node | None = None  # the node the driver started from
    graph: gs.Graph | None = None  # the graph the driver matched in

    def __getitem__(self, name: str):
        return self.bindings[name]

    def get(self, name: str, default=None):
        return self.bindings.get(name, default)

    def value(self, name: str) -> np.ndarray:
        """Values of the constant bound to `name`."""
        return values(self.bindings[name], self.read)

    def __bool__(self) -> bool:
        return self.ok


class _State:
    def __init__(self, read):
        self.bindings: dict[str, Any] = {}
        self.nodes: list[gs.Node] = []
        self.read = read
        self.fail: tuple[int, str, str] | None = None  # (depth, reason, node)
        self.at: list[str] = []  # names of the nodes whose inputs are being matched

    def where(self, tensor: gs.Tensor) -> str:
        """The node to blame for a tensor-level failure: its consumer in the pattern."""
        return self.at[-1] if self.at else _where(tensor)

    def failed(self, reason: str, where: str) -> bool:
        depth = len(self.nodes)
        if self.fail is None or depth > self.fail[0]:
            self.fail = (depth, reason, where)
        elif (depth, where) == (self.fail[0], self.fail[2]) and reason.startswith("expected "):
            self.fail = (depth, _alternatives(self.fail[1], reason), where)
        return False

    def save(self):
        return dict(self.bindings), len(self.nodes)

    def restore(self, saved) -> None:
        self.bindings, n = dict(saved[0]), saved[1]
        del self.nodes[n:]


class Pattern:
    def _match(self, tensor: gs.Tensor, st: _State) -> bool:
        raise NotImplementedError


class Var(Pattern):
    """Any tensor; a name bound twice must be the same tensor."""

    def __init__(self, name: str | None = None, check: Callable[[gs.Tensor], None] | None = None):
        self.name, self.check = name, check

    def _match(self, tensor, st):
        if self.name in st.bindings and st.bindings[self.name] is not tensor:
            return st.failed(f"'{self.name}' is {_label(st.bindings[self.name])} here but {_label(tensor)} there",
                             st.where(tensor))
        if self.check is not None and (why := _refusal(self.check, tensor)):
            return st.failed(why.reason, why.where or st.where(tensor))
        if self.name:
            st.bindings[self.name] = tensor
        return True


class Const(Pattern):
    """A constant; `value` (scalar, compared with tolerance) or `check(values)` (raises Refused)."""

    def __init__(self, name: str | None = None, value: float | None = None,
                 check: Callable[[np.ndarray], None] | None = None, rtol: float = 1e-6):
        self.name, self.value, self.check, self.rtol = name, value, check, rtol

    def _match(self, tensor, st):
        const = constant_of(tensor)
        if const is None:
            return st.failed(f"{_label(tensor)} is not a constant", st.where(tensor))
        if self.value is not None or self.check is not None:
            if elements(const) > SMALL:
                return st.failed(f"constant {const.name} is too large to check", st.where(tensor))
            vals = values(const, st.read)
            if self.value is not None and not close(vals, self.value, self.rtol):
                shown = vals.reshape(-1)[:4].tolist()
                return st.failed(f"constant {const.name} is {shown}, expected {self.value}", st.where(tensor))
            if self.check is not None and (why := _refusal(self.check, vals)):
                return st.failed(f"constant {const.name}: {why.reason}", st.where(tensor))
        if self.name:
            st.bindings[self.name] = tensor
        return True


class Op(Pattern):
    """A node of `op` (in `domain`) producing the tensor, with inputs matching `inputs` in order.

    `attrs`: name -> expected value, or callable(value) -> bool (a missing attribute is None).
    `check(node)` (raises Refused) for anything else. `name` binds the node. `extra_inputs` allows
    trailing inputs the pattern does not list (e.g. Slice axes/steps).
    """

    def __init__(self, op: str, *inputs: Pattern, domain: str = "", attrs: dict | None = None,
                 name: str | None = None, check: Callable[[gs.Node], None] | None = None,
                 extra_inputs: bool = False, commute: bool | None = None):
        self.op, self.inputs, self.domain, self.attrs = op, inputs, domain, attrs or {}
        self.name, self.check, self.extra_inputs = name, check, extra_inputs
        self.commute = (op in COMMUTATIVE and len(inputs) == 2) if commute is None else commute

    def _match(self, tensor, st):
        node = producer(tensor)
        if node is None:
            return st.failed(f"{_label(tensor)} is not computed by a node (expected {self.op})", st.where(tensor))
        if node.op != self.op or (node.domain or "") not in _domains(self.domain):
            return st.failed(f"expected {self.op}, found {_qual(node)}", node.name)
        if len(node.inputs) < len(self.inputs) or (not self.extra_inputs and len(node.inputs) > len(self.inputs)):
            return st.failed(f"{self.op} has {len(node.inputs)} inputs, expected {len(self.inputs)}", node.name)
        for key, want in self.attrs.items():
            got = node.attrs.get(key)
            if not (want(got) if callable(want) else _same(got, want)):
                return st.failed(f"{self.op} attribute {key}={got!r}, expected {_show(want)}", node.name)
        if self.check is not None and (why := _refusal(self.check, node)):
            return st.failed(why.reason, why.where or node.name)
        saved = st.save()
        st.nodes.append(node)
        if self.name:
            st.bindings[self.name] = node
        orders = [self.inputs, self.inputs[::-1]] if self.commute else [self.inputs]
        st.at.append(node.name)
        try:
            for order in orders:
                if all(p._match(t, st) for p, t in zip(order, node.inputs)):
                    return True
                st.restore(saved)
                st.nodes.append(node)
                if self.name:
                    st.bindings[self.name] = node
        finally:
            st.at.pop()
        st.restore(saved)
        return False


class Or(Pattern):
    """The first alternative that matches."""

    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def _match(self, tensor, st):
        saved = st.save()
        for alt in self.alternatives:
            if alt._match(tensor, st):
                return True
            st.restore(saved)
        return False


def Opt(op: str, inner: Pattern, **kwargs) -> Pattern:
    """`inner`, optionally wrapped in one `op` node (e.g. a Cast)."""
    return Or(Op(op, inner, **kwargs), inner)


def match(pattern: Pattern, tensor: gs.Tensor, read: Callable | None = None) -> Match:
    """Match `pattern` against the subgraph producing `tensor`."""
    st = _State(read)
    if pattern._match(tensor, st):
        return Match(True, st.bindings, st.nodes, read=read)
    depth, reason, where = st.fail or (0, "no match", _where(tensor))
    return Match(False, reason=reason, node=where, depth=depth, read=read)


def near(pattern: Pattern, anchor: gs.Node, root_op: str, steps: int = 8, read: Callable | None = None) -> Match:
    """Match `pattern` at the outputs of `root_op` nodes within `steps` consumers after `anchor`.

    The first match that covers `anchor` wins; otherwise the deepest failure is returned, so a miss
    names the condition that stopped the best candidate.
    """
    best: Match | None = None
    seen, frontier = {id(anchor)}, [anchor]
    for _ in range(steps + 1):
        following = []
        for node in frontier:
            if node.op == root_op:
                for out in node.outputs:
                    found = match(pattern, out, read)
                    if found and any(n is anchor for n in found.nodes):
                        return found
                    if found:
                        found = Match(False, reason=f"{root_op} {node.name} matches without {anchor.name}",
                                      node=node.name, depth=0)
                    if best is None or found.depth > best.depth:
                        best = found
            for out in node.outputs:
                for consumer in out.outputs:
                    if id(consumer) not in seen:
                        seen.add(id(consumer))
                        following.append(consumer)
        frontier = following
    if best is not None:
        return best
    return Match(False, reason=f"no {root_op} within {steps} steps after {anchor.op} {anchor.name}", node=anchor.name)


def _refusal(check: Callable, item) -> Refused | None:
    try:
        check(item)
    except Refused as why:
        return why
    return None


def _alternatives(first: str, second: str) -> str:
    """'expected A, found X' + 'expected B, found X' -> 'expected A | B, found X'."""
    a, _, found_a = first.removeprefix("expected ").partition(", found ")
    b, _, found_b = second.removeprefix("expected ").partition(", found ")
    if not first.startswith("expected ") or found_a != found_b or b in a.split(" | "):
        return first
    return f"expected {a} | {b}, found {found_a}"


def _domains(domain: str) -> tuple[str, ...]:
    return ("", "ai.onnx") if domain in ("", "ai.onnx") else (domain,)


def _same(got, want) -> bool:
    if isinstance(want, (list, tuple)):
        return got is not None and list(np.atleast_1d(got)) == list(want)
    return got == want


def _show(want) -> str:
    return getattr(want, "__doc__", None) or "a different value" if callable(want) else repr(want)


def _label(tensor: gs.Tensor) -> str:
    return f"tensor '{tensor.name}'"


def _qual(node: gs.Node) -> str:
    return f"{node.domain}::{node.op}" if node.domain not in (None, "", "ai.onnx") else node.op


def _where(tensor: gs.Tensor) -> str:
    node = producer(tensor)
    return node.name if node is not None else tensor.name
