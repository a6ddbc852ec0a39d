"""Each attention's sliding window, read off the mask the export computes (not from its config).

Sliding-window layers (Mistral, Gemma 2/3 local layers) add a mask that hides keys more than
W - 1 positions back; global layers the causal mask alone. The construction differs per exporter
(TorchScript, dynamo, transformers' own), so the window is measured: the subgraph computing every
site's mask tensor M is run once in onnxruntime on an all-ones 2-D mask of `span` keys (the
compiled T + C: a window that long hides nothing the graphs can hold), and each query row's
visible keys must be the contiguous run ending at its own position:

    row i (position p):  visible = [p - w_i + 1, p]      w_i = p + 1 (global) or W (sliding)

W is the one run length shorter than the row's history; a row pattern that is neither is
reported (`Probe.refused`), so the site is refused rather than given the wrong mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir import execute
from mtkc.ir.constants import SMALL, elements


@dataclass
class Probe:
    windows: dict[str, int | None] = field(default_factory=dict)  # mask tensor -> W, None = global
    refused: dict[str, str] = field(default_factory=dict)  # mask tensor -> why no window fits
    failed: str | None = None  # the subgraph did not run: no window known


def probe(graph: gs.Graph, masks: list[tuple[gs.Tensor, bool]], span: int, root=None) -> Probe:
    """Windows of `masks` ((tensor, additive?): an Add operand, else a Where condition, True = visible).
    Runs on a copy of the mask's subgraph; a weight the construction reads only for its shape (the embedding Gather behind
    `inputs_embeds`) is replaced by one zero row, so no weight is read."""
    result = Probe()
    names = list({t.name: t for t, _ in masks})
    if not names:
        return result
    targets = list({t.name: t for t, _ in masks}.values())
    nodes, inputs = _ancestors(graph, targets)
    sub = gs.Graph(nodes=nodes, inputs=inputs, outputs=targets, opset=graph.opset).copy()  # the mask's nodes only
    sub.import_domains = graph.import_domains
    for node in sub.nodes:
        weight = node.inputs[0] if node.op == "Gather" and node.inputs else None
        if isinstance(weight, gs.Constant) and elements(weight) > SMALL and node.attrs.get("axis", 0) == 0:
            node.inputs[0] = gs.Constant(f"{weight.name}/probe_row", np.zeros([1, *weight.shape[1:]], weight.dtype))
    inputs = sub.inputs
    try:
        values = execute.run(sub, _feeds(inputs, span), root)
    except Exception as exc:  # onnxruntime's own error text: reported, the windows stay unknown
        result.failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return result
    additive = {t.name: a for t, a in masks}
    for name in names:
        m = np.asarray(values[name])
        visible = m > -1.0 if additive[name] else m.astype(bool)
        window = _window(visible.reshape((-1,) + visible.shape[-2:])[0])
        if isinstance(window, str):
            result.refused[name] = window
        else:
            result.windows[name] = window
    return result


def _ancestors(graph: gs.Graph, targets: list[gs.Tensor]) -> tuple[list[gs.Node], list[gs.Variable]]:
    """The nodes computing `targets` (graph order) and the graph inputs they read."""
    inputs = {id(t) for t in graph.inputs}
    seen, needed, stack = set(), set(), list(targets)
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in inputs:
            needed.add(id(t))
        for node in t.inputs:
            stack += node.inputs
    nodes = [n for n in graph.nodes if any(id(o) in seen for o in n.outputs)]
    return nodes, [t for t in graph.inputs if id(t) in needed]


def _feeds(inputs: list[gs.Variable], span: int) -> dict[str, np.ndarray]:
    """All-ones masks, zero ids and caches; symbolic dims: batch 1, lengths `span` (a mask's last
    dim, bound or not, gives the key count; positions count from key 0)."""
    feeds = {}
    for t in inputs:
        shape = [d if isinstance(d, int) else (1 if axis == 0 else span) for axis, d in enumerate(t.shape or [])]
        dtype = np.dtype(t.dtype)
        feeds[t.name] = (np.ones if "mask" in t.name else np.zeros)(shape, dtype)
    total = max((v.shape[-1] for k, v in feeds.items() if "mask" in k and v.ndim == 2), default=span)
    for t in inputs:
        if "position" in t.name and feeds[t.name].ndim:  # the new tokens' positions follow the past keys
            n = feeds[t.name].shape[-1]
            feeds[t.name] = np.broadcast_to(np.arange(total - n, total), feeds[t.name].shape).astype(np.dtype(t.dtype))
    return feeds


def _window(visible: np.ndarray) -> int | None | str:
    """W of a [rows, keys] visibility (bottom-right aligned), None when every row sees its whole
    history, else why it is neither."""
    rows, keys = visible.shape
    window = None
    for i in range(rows):
        own = keys - rows + i
        seen = np.flatnonzero(visible[i])
        if seen.size == 0 or seen[-1] != own or seen.size != seen[-1] - seen[0] + 1:
            return f"query row {i} sees keys {_runs(seen)}, not a run ending at its own key {own}"
        if seen[0] > 0:
            if window not in (None, seen.size):
                return f"query rows see runs of {window} and {seen.size} keys"
            window = seen.size
    if window is not None:
        for i in range(rows):
            if keys - rows + i + 1 > window and visible[i].sum() != window:
                return f"query row {i} sees {int(visible[i].sum())} keys, not the window of {window}"
    return window


def _runs(seen: np.ndarray) -> str:
    return "none" if seen.size == 0 else f"{seen[0]}..{seen[-1]} ({seen.size} of them)"
