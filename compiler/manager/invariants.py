"""Graph invariants the pass manager restores and checks after every pass.

Restored: dead nodes removed (`cleanup`), nodes in topological order, every node named and
names unique (an unnamed or duplicate-named node becomes `<pass>/<its op or old name>`).
Checked (a violation names the pass and the tensor/node):
  - acyclic;
  - no dangling tensor: every node input and graph output is a constant, a graph input,
    or the output of a node in the graph;
  - tensor names unique;
  - once shapes are bound (every graph input static), no pass leaves a tensor it created or
    changed without a dtype, and a pass given a fully static graph keeps it fully static;
  - one float dtype per node where the op's type constraint ties its inputs (`check_dtypes`:
    Add(fp16, fp32) does not load in onnxruntime); a built-in pass that breaks it is a bug in
    mtkc (InternalError, exit 4), a plugin's a PassError;
  - the graph's I/O contract (`check_io`): names (in order), dtypes and shapes of the graph
    inputs and outputs stay as they were. A pass may only refine them (a dtype or dim that was
    unknown or symbolic becomes concrete, as shape binding does). A pass that changes them on
    purpose declares it: it overrides `Pass.map_feeds` (inputs) / `Pass.map_outputs` (outputs),
    so --verify-each can still compare, or sets `Pass.changes_io = True`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from numbers import Integral

import onnx
import onnx_graphsurgeon as gs

import numpy as np

from mtkc.errors import InternalError, MtkcError, PassError
from mtkc.ir.graph_utils import Names, cleanup, plain
from mtkc.ir.toposort import CycleError, keep_sorted, live_nodes, toposort
from mtkc.rewrite.pass_api import Pass


@dataclass
class Sweep:
    """What `restore`'s forward sweep over the nodes it kept found out on the way."""

    loose: tuple[set[str], set[str]]  # `loose_tensors(graph)`
    sound: bool  # no dangling tensor and no name two tensors share: `check` passes but for loose tensors
    mixed: bool  # a node mixes float dtypes its op ties: `check_dtypes` raises
    names: list[str]  # the nodes' names


def restore(graph: gs.Graph, pass_name: str | None = None, error: type[MtkcError] = PassError) -> Sweep | None:
    """Cleanup, cycle check, toposort and node naming after a pass (None: the input model).

    A graph without functions or subgraphs whose live nodes are in an order (what most passes
    leave) takes two sweeps: backwards for what is live (`live_nodes`), forwards for the depths
    `toposort` sorts by and, on the way, what `check`, `loose_tensors` and `check_dtypes` would
    find (returned: a `Sweep`). Any other graph is cleaned and sorted in full; then None."""
    simple = plain(graph)  # a plain graph stays plain; another may lose its subgraphs in cleanup
    swept = None
    if simple:
        live, used = live_nodes(graph)
        swept = _sweep(graph, live, {id(n) for n in graph.nodes})
    if swept is not None:
        keep_sorted(graph, live, used, swept[0])
    else:
        cleanup(graph, simple=simple)
        try:
            toposort(graph, simple=simple or None)
        except CycleError as exc:
            raise error(f"{_stage(pass_name)}: {exc}") from None
    name_nodes(graph, pass_name, swept and swept[1].names)
    return swept and swept[1]


def _sweep(graph: gs.Graph, live: list[gs.Node], members: set[int]) -> tuple[list[int], Sweep] | None:
    """The depths `toposort._sorted_levels` gives `live` and the `Sweep` of a graph listing just
    `live`, in one pass; None when a live node reads a node of `members` listed after it or is
    listed twice (`live` is then no order of the live nodes)."""
    level: dict[int, int] = {}
    get = level.get
    depths: list[int] = []
    untyped: set[str] = set()
    dynamic: set[str] = set()
    by_name: dict[str, gs.Tensor] = {}
    named = by_name.setdefault
    inputs = {id(t) for t in graph.inputs}
    sound, mixed = True, False
    names: list[str] = []
    variable, constant = gs.Variable, gs.Constant

    def look(t: gs.Tensor) -> None:  # loose_tensors' look
        if isinstance(t, variable):
            if t.dtype is None:
                untyped.add(t.name)
            if not static(t):
                dynamic.add(t.name)

    def mention(t: gs.Tensor) -> bool:  # a named tensor `check` names: False when another has its name
        look(t)
        return named(t.name, t) is t

    for t in graph.inputs:
        if t.name:
            sound = mention(t) and sound
    for node in live:
        deepest = -1
        for t in node.inputs:
            producers = t.inputs
            for p in producers:
                d = get(id(p))
                if d is None:
                    if id(p) in members:
                        return None
                elif d > deepest:
                    deepest = d
            if not t.name:
                continue
            if isinstance(t, constant):
                sound = mention(t) and sound
            elif producers:
                sound = sound and (get(id(producers[0])) is not None or id(t) in inputs)
            else:
                look(t)
                sound = sound and id(t) in inputs
        level[id(node)] = deepest = deepest + 1
        depths.append(deepest)
        names.append(node.name)
        for t in node.outputs:
            if t.name:
                sound = mention(t) and sound
        if not mixed and not node.domain and node.op in _TIED:
            mixed = len(_floats(node)) > 1
    if len(level) != len(live):
        return None
    for t in graph.outputs:
        if t.name:
            made = isinstance(t, constant) or id(t) in inputs or bool(t.inputs) and get(id(t.inputs[0])) is not None
            sound = mention(t) and made and sound
    return depths, Sweep((untyped, dynamic), sound, mixed, names)


def name_nodes(graph: gs.Graph, prefix: str | None, given: list[str] | None = None) -> int:
    """Give unnamed/duplicate-named nodes `<prefix>/<old name or op>`; returns how many. `given`:
    the nodes' names, when the caller has them."""
    given = [n.name for n in graph.nodes] if given is None else given
    if all(given) and len(set(given)) == len(given):
        return 0  # the common case, without building `Names` (it collects every tensor name)
    names = Names(graph)
    seen: set[str] = set()
    renamed = 0
    for node in graph.nodes:
        if not node.name or node.name in seen:
            base = node.name or node.op
            node.name = names.new(f"{prefix}/{base}" if prefix else base)
            renamed += 1
        seen.add(node.name)
    return renamed


def shapes_bound(graph: gs.Graph) -> bool:
    return all(static(t) for t in graph.inputs)


def loose_tensors(graph: gs.Graph) -> tuple[set[str], set[str]]:
    """(names of variables without a dtype, names of variables without a static shape), over every
    named variable the graph mentions. A node input that is a variable is a graph input, some
    node's output or dangling, so of the inputs only those without a producer are looked at."""
    untyped, dynamic = set(), set()

    def look(t: gs.Tensor) -> None:
        if t.name and isinstance(t, gs.Variable):
            if t.dtype is None:
                untyped.add(t.name)
            if not static(t):
                dynamic.add(t.name)

    for t in graph.inputs:
        look(t)
    for node in graph.nodes:
        for t in node.inputs:
            if not t.inputs:
                look(t)
        for t in node.outputs:
            look(t)
    for t in graph.outputs:
        look(t)
    return untyped, dynamic


def check(
    graph: gs.Graph,
    pass_name: str | None = None,
    loose_before: tuple[set[str], set[str]] | None = None,
    error: type[MtkcError] = PassError,
    loose_now: tuple[set[str], set[str]] | None = None,
) -> None:
    """Raise `error` naming the pass and the culprit when an invariant does not hold.

    `loose_now`: `loose_tensors(graph)` as it is, when the caller has it (spares a walk when the
    pass left nothing loose that was not before)."""
    stage = _stage(pass_name)
    in_graph = {id(n) for n in graph.nodes}
    graph_inputs = {id(t) for t in graph.inputs}

    def produced(t: gs.Tensor) -> bool:
        return (
            isinstance(t, gs.Constant)
            or not t.name  # an omitted optional input
            or id(t) in graph_inputs
            or (len(t.inputs) > 0 and id(t.inputs[0]) in in_graph)
        )

    by_name: dict[str, gs.Tensor] = {}
    twice: list[str] = []  # names two tensors share, in `_tensors` order: reported after dangling inputs

    def named(t: gs.Tensor) -> None:
        if t.name and by_name.setdefault(t.name, t) is not t:
            twice.append(t.name)

    for t in graph.inputs:
        named(t)
    for node in graph.nodes:  # in topological order: a variable input was named with its producer's outputs
        for t in node.inputs:
            if isinstance(t, gs.Constant):
                named(t)
            elif not produced(t):
                raise error(f"{stage}: node '{node.name}' reads tensor '{t.name}', which no node, input or constant produces")
        for t in node.outputs:
            named(t)
    for t in graph.outputs:
        if not produced(t):
            raise error(f"{stage}: graph output '{t.name}' is not produced by any node")
        named(t)
    if twice:
        raise error(f"{stage}: two different tensors are named '{twice[0]}'")

    if loose_before is not None and shapes_bound(graph):
        if loose_now is not None and not new_loose(loose_now, loose_before):
            return
        untyped, dynamic = loose_before
        for t in _variables(graph):
            if t.dtype is None and t.name not in untyped:
                raise error(f"{stage}: tensor '{t.name}' has no dtype")
            if not dynamic and not static(t):
                raise error(f"{stage}: tensor '{t.name}' has no static shape ({_shape_text(t)}) in a static graph")


def new_loose(now: tuple[set[str], set[str]], before: tuple[set[str], set[str]]) -> bool:
    """Did a pass leave a tensor untyped, or a static graph with a dynamic tensor (`loose_tensors`
    after and before it)?"""
    return bool(now[0] - before[0]) or (not before[1] and bool(now[1]))


_TIED = {op: None for op in ("Add", "Sub", "Mul", "Div", "MatMul", "Max", "Min", "Sum", "Mean", "Concat", "Equal",
                              "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Gemm")}  # None: all inputs
_TIED["Where"] = (1, 2)


def check_dtypes(graph: gs.Graph, p=None, error: type[MtkcError] | None = None) -> None:
    """Raise when a node's tied inputs have two float dtypes (known ones; see the module docstring)."""
    for node in graph.nodes:
        if node.domain or node.op not in _TIED:
            continue
        floats = _floats(node)
        if len(floats) > 1:
            what = f"node '{node.name}' ({node.op}) mixes {' and '.join(sorted(floats))} inputs"
            if p is None:
                raise (error or PassError)(f"input model: {what}")
            if getattr(p, "origin", "built-in") == "built-in":
                raise InternalError(f"pass '{p.name}' left {what}: a bug in mtkc; rerun with MTKC_TRACEBACK=1 and "
                                    "report the output")
            raise PassError(f"pass '{p.name}' ({p.origin}) left {what}")


def _floats(node: gs.Node) -> set[str]:
    """The float dtypes of the inputs `node`'s op ties (`_TIED`), known ones."""
    positions = _TIED[node.op] or range(len(node.inputs))
    return {_float_name(node.inputs[i].dtype) for i in positions if i < len(node.inputs)
            and node.inputs[i].dtype is not None} - {None}


@functools.cache
def _float_name(dtype) -> str | None:
    """numpy's name of a float dtype (ONNX's for one numpy has no name for, as graphsurgeon leaves
    bfloat16), None for any other."""
    try:
        return np.dtype(dtype).name if np.issubdtype(np.dtype(dtype), np.floating) else None
    except TypeError:
        try:
            name = onnx.TensorProto.DataType.Name(int(dtype)).lower()
        except (TypeError, ValueError):
            return None
        return name if "float" in name else None


def io_contract(graph: gs.Graph) -> tuple[list[tuple], list[tuple]]:
    """(inputs, outputs) as [(name, dtype, shape)]: what a caller of the graph relies on."""
    def spec(t: gs.Tensor) -> tuple:
        return t.name, t.dtype, None if t.shape is None else tuple(t.shape)

    return [spec(t) for t in graph.inputs], [spec(t) for t in graph.outputs]


def check_io(graph: gs.Graph, p, before: tuple[list[tuple], list[tuple]]) -> tuple[list[tuple], list[tuple]]:
    """Raise PassError naming pass `p` when it changed the I/O contract undeclared; returns the new one."""

    now = io_contract(graph)
    declared = (getattr(p, "changes_io", False) or type(p).map_feeds is not Pass.map_feeds,
                getattr(p, "changes_io", False) or type(p).map_outputs is not Pass.map_outputs)
    for side, old, new, allowed in zip(("input", "output"), before, now, declared):
        if allowed:
            continue
        problem = _contract_change(old, new)
        if problem:
            raise PassError(f"pass '{p.name}' ({p.origin}) {problem} of a graph {side} without declaring it "
                            "(override Pass.map_feeds/map_outputs or set changes_io = True)")
    return now


def _contract_change(old: list[tuple], new: list[tuple]) -> str | None:
    """What differs between two I/O lists beyond refinement, or None."""
    if [t[0] for t in old] != [t[0] for t in new]:
        gone = [n for n, _, _ in old if n not in {t[0] for t in new}]
        added = [n for n, _, _ in new if n not in {t[0] for t in old}]
        if gone:
            return f"removed or renamed '{gone[0]}'" + (f" (now '{added[0]}')" if added else "")
        if added:
            return f"added '{added[0]}'"
        return "reordered the names"
    for (name, dtype, shape), (_, dtype2, shape2) in zip(old, new):
        if dtype is not None and dtype2 != dtype:
            return f"changed the dtype of '{name}' ({_dtype_text(dtype)} -> {_dtype_text(dtype2)})"
        if shape is not None and (shape2 is None or len(shape2) != len(shape)
                                  or any(_concrete(a) and a != b for a, b in zip(shape, shape2))):
            return f"changed the shape of '{name}' ({_dims(shape)} -> {_dims(shape2)})"
    return None


def _concrete(d) -> bool:
    return isinstance(d, Integral) and d >= 0


def _dims(shape) -> str:
    return "unknown" if shape is None else "[" + ",".join(str(d) for d in shape) + "]"


def _dtype_text(dtype) -> str:
    return getattr(dtype, "__name__", None) or str(dtype)


def _stage(pass_name: str | None) -> str:
    return f"pass '{pass_name}'" if pass_name else "input model"


def _tensors(graph: gs.Graph) -> list[gs.Tensor]:
    """Graph inputs, each node's inputs and outputs, graph outputs (repeats kept), in that order."""
    found = list(graph.inputs)
    for node in graph.nodes:
        found += node.inputs
        found += node.outputs
    found += graph.outputs
    return found


def _variables(graph: gs.Graph) -> list[gs.Variable]:
    """The named variables of `_tensors`, each once, in first-seen order."""
    unique = {id(t): t for t in _tensors(graph) if t.name and isinstance(t, gs.Variable)}
    return list(unique.values())


def static(t: gs.Tensor) -> bool:
    if t.shape is None:
        return False
    for d in t.shape:  # a loop, not all(<generator>): this runs for every tensor after every pass
        if not ((isinstance(d, int) or isinstance(d, Integral)) and d >= 0):
            return False
    return True


def _shape_text(t: gs.Tensor) -> str:
    return "unknown" if t.shape is None else "[" + ",".join(str(d) for d in t.shape) + "]"
