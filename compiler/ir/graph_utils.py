"""Small helpers shared by rewrite passes: constants, static shapes, rewiring uses, fresh names.

Constants are read through `values(t, ctx)` so external weights are read only when a pass
really needs them (and `small_values` refuses to read anything big at all).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

SMALL_BYTES = 1024  # "small" constants: shape operands, axes, scalars


def is_const(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant)


def nbytes(t: gs.Constant) -> int:
    v = t._values
    return int(v.nbytes)


def is_lazy(t: gs.Constant) -> bool:
    return isinstance(t._values, gs.ir.tensor.LazyValues)


def values(t: gs.Constant, ctx: Any = None) -> np.ndarray:
    """The values of a constant; lazy (possibly external) ones are read via `ctx.read_values`."""
    if is_lazy(t):
        if ctx is not None and ctx.read_values is not None:
            return np.asarray(ctx.read_values(t))
        if t._values.tensor.data_location == 1:  # EXTERNAL and nobody to read it
            raise ValueError(f"constant '{t.name}' has external data and no reader")
    return np.asarray(t.values)


def small_values(t: gs.Tensor, ctx: Any = None, limit: int = SMALL_BYTES) -> np.ndarray | None:
    """Values of a constant of at most `limit` bytes, else None (never reads a big weight)."""
    if not is_const(t) or nbytes(t) > limit:
        return None
    return values(t, ctx)


def ints(t: gs.Tensor, ctx: Any = None) -> list[int] | None:
    """A small integer constant as a flat list of ints, else None."""
    v = small_values(t, ctx)
    if v is None or not np.issubdtype(v.dtype, np.integer):
        return None
    return [int(x) for x in v.reshape(-1)]


def static_shape(t: gs.Tensor) -> tuple[int, ...] | None:
    """The shape as ints when every dim is a known non-negative int, else None."""
    shape = t.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def dtype_of(t: gs.Tensor) -> np.dtype | None:
    try:
        return np.dtype(t.dtype) if t.dtype is not None else None
    except TypeError:
        return None


def make_constant(name: str, array: Any, dtype: Any = None) -> gs.Constant:
    return gs.Constant(name, np.asarray(array, dtype=dtype))


def single_consumer(t: gs.Tensor, graph_outputs: set[str]) -> bool:
    return len(t.outputs) == 1 and t.name not in graph_outputs


def renamable(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> bool:
    """`replace_uses(old, new)` needs no Identity: `old` is no graph output, or `new` can take its name."""
    if not any(t is old for t in graph.outputs):
        return True
    io = {id(t) for t in graph.inputs} | {id(t) for t in graph.outputs}
    return isinstance(new, gs.Variable) and bool(new.inputs) and id(new) not in io


def replace_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Every consumer of `old` reads `new` instead; a graph output keeps its name.

    When `old` is a graph output, `new` takes over its name if it is a node output that is not
    itself graph I/O; otherwise an Identity named after the old producer keeps the output.
    """
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new
    if not any(t is old for t in graph.outputs):
        return
    if renamable(graph, old, new):
        name, dtype, shape = old.name, old.dtype, old.shape
        old.name = f"{name}/replaced"
        new.name = name
        if new.dtype is None:
            new.dtype = dtype
        if new.shape is None:
            new.shape = shape
        _swap_output(graph, old, new)
        return
    out = gs.Variable(old.name, dtype=old.dtype, shape=old.shape)
    old.name = f"{old.name}/replaced"
    graph.nodes.append(gs.Node("Identity", name=f"{out.name}/keep", inputs=[new], outputs=[out]))
    _swap_output(graph, old, out)


def _swap_output(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    for i, t in enumerate(graph.outputs):
        if t is old:
            graph.outputs[i] = new


def bypass(graph: gs.Graph, node: gs.Node, source: gs.Tensor | None = None) -> None:
    """Remove a single-output no-op `node`: its consumers read `source` (default: input 0)."""
    out = node.outputs[0]
    replace_uses(graph, out, node.inputs[0] if source is None else source)
    node.outputs.clear()
    node.inputs.clear()


def keep_inputs(node: gs.Node, n: int) -> None:
    """Drop every input of `node` after the first `n` (graphsurgeon lists have no slice delete)."""
    while len(node.inputs) > n:
        node.inputs.pop()


class Names:
    """Fresh node and tensor names for one pass run: `<base>/<suffix>`, numbered on clashes."""

    def __init__(self, graph: gs.Graph, pass_name: str):
        self.pass_name = pass_name
        self.used = {n.name for n in graph.nodes} | set(graph.tensors())

    def new(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}/{k}"
        self.used.add(name)
        return name

    def node(self, origin: gs.Node | str, suffix: str) -> str:
        """A name for a node created while rewriting `origin`: `<origin>/<pass>/<suffix>`."""
        base = origin.name if isinstance(origin, gs.Node) else origin
        return self.new(f"{base}/{self.pass_name}/{suffix}")


def add_node(graph: gs.Graph, names: Names, origin: gs.Node | str, op: str, inputs: list[gs.Tensor],
             dtype: Any = None, shape: Any = None, attrs: dict | None = None, suffix: str | None = None) -> gs.Variable:
    """Append one single-output node named after `origin`; returns its output tensor."""
    name = names.node(origin, suffix or op)
    out = gs.Variable(names.new(f"{name}:0"), dtype=dtype, shape=shape)
    graph.nodes.append(gs.Node(op, name=name, attrs=dict(attrs or {}), inputs=list(inputs), outputs=[out]))
    return out


# --- linear-time toposort / cleanup (graphsurgeon's results, without its per-node overhead) -----


def _plain(graph: gs.Graph) -> bool:
    """No functions and no node with a subgraph attribute: the fast paths below apply."""
    return not graph.functions and not any(isinstance(v, gs.Graph) for n in graph.nodes for v in n.attrs.values())


def topo_order(graph: gs.Graph) -> list[gs.Node]:
    """The node order `Graph.toposort()` gives (depth from the inputs, ties in graphsurgeon's
    first-visit order), computed in linear time; the graph is not changed.

    Producers outside `graph.nodes` are ignored. Raises graphsurgeon's exception on a cycle.
    """
    from onnx_graphsurgeon.util.exception import OnnxGraphSurgeonException

    members = {id(n) for n in graph.nodes}

    def producers(node: gs.Node):
        for t in node.inputs:
            for p in t.inputs:
                if id(p) in members:
                    yield p

    level: dict[int, int] = {}
    visited: list[gs.Node] = []  # post-order: graphsurgeon's insertion order
    for root in graph.nodes:
        if id(root) in level:
            continue
        stack = [(root, producers(root), [-1])]
        on_path = {id(root)}
        while stack:
            node, pending, deepest = stack[-1]
            for p in pending:
                if id(p) in level:
                    deepest[0] = max(deepest[0], level[id(p)])
                    continue
                if id(p) in on_path:
                    raise OnnxGraphSurgeonException("Cycle detected in graph! Are there tensors with duplicate names in the graph?")
                on_path.add(id(p))
                stack.append((p, producers(p), [-1]))
                break
            else:
                stack.pop()
                on_path.discard(id(node))
                level[id(node)] = deepest[0] + 1
                visited.append(node)
                if stack:
                    parent = stack[-1][2]
                    parent[0] = max(parent[0], level[id(node)])
    return sorted(visited, key=lambda n: level[id(n)])


def toposort(graph: gs.Graph) -> gs.Graph:
    """`graph.toposort()` in linear time (graphsurgeon's own for graphs with subgraphs/functions)."""
    if not _plain(graph):
        return graph.toposort()
    graph.nodes = topo_order(graph)
    return graph


def cleanup(graph: gs.Graph) -> gs.Graph:
    """`graph.cleanup()` (default arguments) in linear time: drop nodes no graph output depends
    on, clearing their inputs/outputs; graph inputs lose their producers; I/O lists untouched."""
    if not _plain(graph):
        return graph.cleanup()
    for t in graph.inputs:
        t.inputs.clear()
    members = {id(n) for n in graph.nodes}
    used: set[int] = set()
    seen: set[int] = set()
    stack = [t for t in graph.outputs]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for p in t.inputs:
            if id(p) in members and id(p) not in used:
                used.add(id(p))
                stack.extend(p.inputs)
    dead = [n for n in graph.nodes if id(n) not in used]
    for node in dead:
        node.inputs.clear()
        node.outputs.clear()
    if dead:
        graph.nodes = [n for n in graph.nodes if id(n) in used]
    return graph
