"""`layer-chunks`: keep chunk k of N decoder-layer ranges (as even as possible, `plan.chunk_ranges`).

The residual stream tensor entering the chunk's first layer becomes input `hidden_states`, the
one leaving its last layer output `hidden_states_out` (embedding stays in chunk 0, final norm +
lm_head in chunk N-1). Layer boundaries are `mtkc.analysis.regions`' (the residual stream on the
logits' dominator chain above layer i's attention), the ones quantisation units are cut by. Layer i
is the DecoderMap's (`mtkc.analysis.decoder`), whose cache reads `past_<kind>_<i>`.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.errors import InputError
from mtkc.ir.execute import run
from mtkc.analysis.cache import KINDS, layer_caches
from mtkc.analysis.regions import layer_boundaries
from mtkc.ir.graph_utils import tensor_map
from mtkc.passes.kv_cache.io import contract_order
from mtkc.passes.kv_cache.plan import chunk_ranges, kv_on
from mtkc.rewrite.pass_api import Context, Pass, PassResult, register


@register
class LayerChunks(Pass):
    name = "layer-chunks"
    description = "keep chunk k of N near-equal decoder-layer ranges; hidden_states in / hidden_states_out out"
    idempotent = False

    def applies(self, ctx: Context) -> bool:
        return kv_on(ctx.options) and (ctx.options.chunks or 1) > 1

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        n, k = ctx.options.chunks or 1, ctx.options.chunk or 0
        dm = ctx.analysis(decoder_map, graph)
        layers = layer_caches(graph, dm)
        ranges = chunk_ranges(len(layers), n)
        if not 0 <= k < n:
            raise InputError(f"chunk {k} out of range for --chunks {n}")
        first, last = ranges[k].start, ranges[k].stop
        bounds = layer_boundaries(graph, dm)
        keep = {f"present_{kind}_{i}" for i in range(first, last) for kind in KINDS}
        outputs = [o for o in graph.outputs if o.name in keep]
        if last < len(layers):
            out = bounds[last]
            out.name = "hidden_states_out"
            out.dtype, out.shape = out.dtype or np.float32, _hidden_shape(out, ctx)
            outputs.insert(0, out)
        else:
            outputs.insert(0, next(o for o in graph.outputs if o.name == "logits"))
        self.kept = {o.name for o in outputs}
        self.prefix = None
        if first > 0 and ctx.options.verify_each:  # map_feeds computes hidden_states with it
            self.prefix = graph.copy()
            self.prefix.outputs = [tensor_map(self.prefix)[bounds[first].name]]
            self.prefix.cleanup(remove_unused_graph_inputs=True)
        if first > 0:
            cut = bounds[first]
            for x in graph.inputs:
                if x.name == "hidden_states":  # chunk 0's input (host embedding): dead here
                    x.name = "hidden_states/embedded"
            hidden = gs.Variable("hidden_states", cut.dtype or np.float32, _hidden_shape(cut, ctx))
            for node in list(cut.outputs):
                for j, x in enumerate(node.inputs):
                    if x is cut:
                        node.inputs[j] = hidden
            graph.inputs = [hidden] + [x for x in graph.inputs if x.name != "hidden_states/embedded"]
        graph.outputs = outputs
        graph.cleanup(remove_unused_graph_inputs=True)
        contract_order(graph)
        return PassResult(rewrites=1, notes=[f"chunk {k}/{n}: layers {first}..{last - 1}"])

    def map_feeds(self, feeds, ctx):
        if self.prefix is None:
            return feeds

        hidden = next(iter(run(self.prefix, {t.name: feeds[t.name] for t in self.prefix.inputs}, ctx.root).values()))
        return {**feeds, "hidden_states": hidden}

    def map_outputs(self, outputs, ctx):
        return {k: v for k, v in outputs.items() if k in self.kept}


def _hidden_shape(tensor: gs.Tensor, ctx: Context):
    """[1, T, H]: the residual stream's bound shape (a fused op's output may keep export symbols)."""
    shape = tensor.shape
    if shape is None or len(shape) != 3:
        return shape
    return [1, ctx.options.seq_len or shape[1], shape[2]]
