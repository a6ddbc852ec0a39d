"""`--verify-each`: after every pass that changed the graph, run it in onnxruntime and compare
with the input model on the same seeded inputs; the first pass that changes the numbers is named.

Tolerances are onnxruntime's fp32 provider checks (atol 1e-5, rtol 1e-4); integer and bool
outputs must match exactly. A pass that replaces graph inputs or outputs maps feeds and expected
outputs through `Pass.map_feeds` / `Pass.map_outputs` (see `mtkc.rewrite.pass_api`).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.errors import InputError, MismatchError, PassError
from mtkc.ir import execute
from mtkc.ir.compare import compare as errors
from mtkc.manager.guard import guarded, one_line
from mtkc.rewrite.pass_api import Context, Pass

ATOL, RTOL = 1e-5, 1e-4


class EachVerifier:
    """Compare the graph after each changing pass with the input model, on seeded inputs.

    The input model runs once, up front, on seeded inputs whose symbolic dims are bound the way
    the pipeline binds them (the registry's `bind-shapes` pass on a copy, with the compile options).
    Passes that change the I/O contract map feeds and expected outputs through
    `Pass.map_feeds` / `Pass.map_outputs`.
    """

    def __init__(self, graph: gs.Graph, ctx: Context, seed: int = 0, bind: type[Pass] | None = None,
                 atol: float = ATOL, rtol: float = RTOL):
        self.ctx, self.atol, self.rtol = ctx, atol, rtol
        self.pending: list[Pass] = []
        inputs = _bound_inputs(graph, ctx, bind)
        self.feeds = _positions_follow_cache(execute.seeded_inputs(gs.Graph(inputs=inputs), seed))
        try:
            self.expected = execute.run(gs.export_onnx(graph, do_type_check=False), self.feeds, ctx.root)
        except Exception as exc:
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.feeds.items())
            raise InputError(
                f"--verify-each: the input model does not run on seeded inputs ({shapes}): {one_line(exc)}; "
                "bind its dims with --seq-len/--cache-len/--input-shape"
            ) from None

    def after(self, p: Pass, graph: gs.Graph, changed: bool) -> None:
        self.pending.append(p)
        if not changed:
            return
        for q in self.pending:
            self.feeds = guarded(q, "map_feeds", q.map_feeds, self.feeds, self.ctx)
            self.expected = guarded(q, "map_outputs", q.map_outputs, self.expected, self.ctx)
        self.pending.clear()
        missing = [t.name for t in graph.inputs if t.name not in self.feeds]
        if missing:
            raise PassError(f"pass '{p.name}' added input '{missing[0]}' but does not map feeds to it (Pass.map_feeds)")
        try:
            actual = execute.run(graph, {t.name: self.feeds[t.name] for t in graph.inputs}, self.ctx.root)
        except Exception as exc:
            raise PassError(f"pass '{p.name}': the rewritten graph does not run in onnxruntime: {one_line(exc)}") from None
        for name, want in self.expected.items():
            if name not in actual:
                raise MismatchError(f"--verify-each: pass '{p.name}' removed output '{name}' (declare Pass.map_outputs)")
            problem = compare(actual[name], want, self.atol, self.rtol)
            if problem:
                raise MismatchError(f"--verify-each: pass '{p.name}' changed the numbers: output '{name}' {problem}")


def _bound_inputs(graph: gs.Graph, ctx: Context, bind: type[Pass] | None) -> list[gs.Variable]:
    """The graph inputs with dims bound as the `bind-shapes` pass (`bind`, the registry's) binds them (on a copy)."""
    copy = graph.copy()
    binder = bind() if bind is not None else None
    if binder is not None and binder.applies(ctx):
        binder.run(copy, ctx)
    return [gs.Variable(t.name, t.dtype, list(t.shape or [])) for t in copy.inputs]


def _positions_follow_cache(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Integer `position_ids` [B, T] become past + arange(T) (rewrites may tabulate RoPE for
    exactly the positions a static graph can see), past = the cache length of `past_key*`."""
    ids = feeds.get("position_ids")
    if ids is None or ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        return feeds
    past = next((v.shape[-2] for k, v in sorted(feeds.items()) if k.startswith("past_key") and v.ndim >= 2), 0)
    positions = past + np.arange(ids.shape[1], dtype=ids.dtype)
    return {**feeds, "position_ids": np.broadcast_to(positions, ids.shape).copy()}


def compare(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> str:
    """'' when equal within tolerance (exact for non-float), else what differs."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"has shape {list(actual.shape)}, expected {list(expected.shape)}"
    if not np.issubdtype(expected.dtype, np.floating):
        if np.array_equal(actual, expected):
            return ""
        return f"differs in {int(np.sum(actual != expected))} of {expected.size} values"
    max_abs, _, cosine, close = errors(actual, expected, atol, rtol)
    return "" if close else f"max abs error {max_abs:.3g}, cosine {cosine:.6f} (atol {atol:g}, rtol {rtol:g})"
