"""Small graph helpers shared by rewrite passes: static shapes, rewiring uses, fresh names, dead-node removal.

Constants are read with `mtkc.ir.constants`; topological order and cycles are `mtkc.ir.toposort`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs


def static_shape(t: gs.Tensor) -> tuple[int, ...] | None:
    """The shape as ints when every dim is a known non-negative int, else None."""
    shape = t.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def tensor_map(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """`graph.tensors()` (name -> tensor in walk order: graph inputs, each node's inputs and outputs,
    graph outputs; a repeated name keeps its first place and its last tensor) in a third of the time,
    and without graphsurgeon's warning, which prints a model's names unescaped."""
    found: dict[str, gs.Tensor] = {}
    for t in graph.inputs:
        if t.name != "":
            found[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            if t.name != "":
                found[t.name] = t
        for t in node.outputs:
            if t.name != "":
                found[t.name] = t
    for t in graph.outputs:
        if t.name != "":
            found[t.name] = t
    return found


def dtype_of(t: gs.Tensor) -> np.dtype | None:
    try:
        return np.dtype(t.dtype) if t.dtype is not None else None
    except TypeError:
        return None


def make_constant(name: str, array: Any, dtype: Any = None) -> gs.Constant:
    return gs.Constant(name, np.asarray(array, dtype=dtype))


def is_used(graph: gs.Graph, t: gs.Tensor) -> bool:
    """Some node reads `t`, or it is a graph output."""
    return bool(t.outputs) or any(o is t for o in graph.outputs)


def renamable(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> bool:
    """`replace_uses(old, new)` needs no Identity: `old` is no graph output, or `new` can take its name."""
    if not any(t is old for t in graph.outputs):
        return True
    io = {id(t) for t in graph.inputs} | {id(t) for t in graph.outputs}
    return isinstance(new, gs.Variable) and bool(new.inputs) and id(new) not in io


def replace_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor, outputs: set[int] | None = None) -> None:
    """Every consumer of `old` reads `new` instead; a graph output keeps its name.

    When `old` is a graph output, `new` takes over its name if it is a node output that is not
    itself graph I/O; otherwise an Identity named after the old producer keeps the output.
    `outputs`: the ids of `graph.outputs`, when the caller keeps them (kept up to date here): a
    walk that replaces a tensor per layer then costs O(1) a replacement, not O(graph outputs).
    """
    rewire(old, new)
    if not (id(old) in outputs if outputs is not None else any(t is old for t in graph.outputs)):
        return
    if outputs is not None:
        outputs.discard(id(old))
    if renamable(graph, old, new):
        name, dtype, shape = old.name, old.dtype, old.shape
        old.name = f"{name}/replaced"
        new.name = name
        if new.dtype is None:
            new.dtype = dtype
        if new.shape is None:
            new.shape = shape
        _swap_output(graph, old, new, outputs)
        return
    out = gs.Variable(old.name, dtype=old.dtype, shape=old.shape)
    old.name = f"{old.name}/replaced"
    graph.nodes.append(gs.Node("Identity", name=f"{out.name}/keep", inputs=[new], outputs=[out]))
    _swap_output(graph, old, out, outputs)


def rewire(old: gs.Tensor, new: gs.Tensor) -> None:
    """Every consumer of `old` reads `new` instead (graph outputs untouched: `replace_uses` for those)."""
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new


def _swap_output(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor, outputs: set[int] | None) -> None:
    for i, t in enumerate(graph.outputs):
        if t is old:
            graph.outputs[i] = new
    if outputs is not None:
        outputs.add(id(new))


def bypass(graph: gs.Graph, node: gs.Node, source: gs.Tensor | None = None, outputs: set[int] | None = None) -> None:
    """Remove a single-output no-op `node`: its consumers read `source` (default: input 0).
    `outputs`: as `replace_uses` takes it."""
    out = node.outputs[0]
    replace_uses(graph, out, node.inputs[0] if source is None else source, outputs)
    node.outputs.clear()
    node.inputs.clear()


# graphsurgeon keeps `tensor.outputs` (readers) and `tensor.inputs` (producers) in step with
# `node.inputs`/`node.outputs`; unhooking a node does `list.remove` there, which compares with
# `Node.__eq__` (names, attributes, every input and output) each reader before it: quadratic in a
# tensor's readers (a shared constant has hundreds). Node names are unique (the pass manager's
# invariant), so the node to unhook is the one identical to it: found by identity below.


def _unhook(items: list, obj) -> None:
    for k, x in enumerate(items):
        if x is obj:
            list.__delitem__(items, k)  # the base class's: no sync back
            return


def set_input(node: gs.Node, i: int, new: gs.Tensor) -> None:
    """`node.inputs[i] = new`, unhooking `node` from the old tensor's readers by identity."""
    _unhook(node.inputs[i].outputs, node)
    list.__setitem__(node.inputs, i, new)
    list.append(new.outputs, node)


def clear_inputs(node: gs.Node) -> None:
    """`node.inputs.clear()`, unhooking `node` from each input's readers by identity."""
    for t in node.inputs:
        _unhook(t.outputs, node)
    list.clear(node.inputs)


def detach(nodes: list[gs.Node]) -> None:
    """`inputs.clear()` and `outputs.clear()` of every node in `nodes`, unhooking by identity; the
    other readers/producers of their tensors keep their order."""
    gone = {id(n) for n in nodes}
    touched = {id(t): t for n in nodes for t in (*n.inputs, *n.outputs)}
    for t in touched.values():
        for side in (t.inputs, t.outputs):
            if any(id(x) in gone for x in side):
                list.__setitem__(side, slice(None), [x for x in side if id(x) not in gone])
    for n in nodes:
        list.clear(n.inputs)
        list.clear(n.outputs)


def keep_inputs(node: gs.Node, n: int) -> None:
    """Drop every input of `node` after the first `n` (graphsurgeon lists have no slice delete)."""
    while len(node.inputs) > n:
        node.inputs.pop()


class Names:
    """Fresh node and tensor names in one graph: `new(base)` gives `base`, then `base/1`, `base/2`, ..."""

    def __init__(self, graph: gs.Graph):
        self.used = {n.name for n in graph.nodes} | set(tensor_map(graph))

    def new(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}/{k}"
        self.used.add(name)
        return name


# --- linear-time cleanup (graphsurgeon's result, without its per-node overhead) -------------------


def plain(graph: gs.Graph) -> bool:
    """No functions and no node with a subgraph attribute: the fast paths below apply."""
    if graph.functions:
        return False
    for n in graph.nodes:  # loops, not any(<generator>): this runs twice after every pass
        for v in n.attrs.values():
            if isinstance(v, gs.Graph):
                return False
    return True


def cleanup(graph: gs.Graph, unused_inputs: bool = False, simple: bool | None = None) -> gs.Graph:
    """`graph.cleanup(remove_unused_graph_inputs=unused_inputs)` in linear time: drop nodes no graph
    output depends on, clearing their inputs/outputs; graph inputs lose their producers; with
    `unused_inputs`, graph inputs nothing reads are dropped (by name, and through producers outside
    `graph.nodes`, as graphsurgeon does; without it only the graph's own nodes count).
    `simple`: `plain(graph)`, when the caller knows it."""
    if not (plain(graph) if simple is None else simple):
        return graph.cleanup(remove_unused_graph_inputs=unused_inputs)
    for t in graph.inputs:
        t.inputs.clear()
    members = {id(n) for n in graph.nodes}
    used: set[int] = set()
    seen: dict[int, gs.Tensor] = {}
    stack = [t for t in graph.outputs]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen[id(t)] = t
        for p in t.inputs:
            if (unused_inputs or id(p) in members) and id(p) not in used:
                used.add(id(p))
                stack.extend(p.inputs)
    if unused_inputs:
        read = {t.name for t in seen.values()}
        graph.inputs = [t for t in graph.inputs if t.name in read]
    dead = [n for n in graph.nodes if id(n) not in used]
    detach(dead)
    if dead:
        graph.nodes = [n for n in graph.nodes if id(n) in used]
    return graph
