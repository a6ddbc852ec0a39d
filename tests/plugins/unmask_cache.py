"""A deliberately wrong plugin pass: the additive mask stops hiding cache slots (every slot visible).

What an export without a mask input does when its cache is made static: empty (zero) slots are
attended. Per-graph comparison cannot see it (it feeds a cache whose every slot holds a token);
verify's oracle must."""

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.rewrite.pass_api import Pass, PassResult, register


@register
class UnmaskCache(Pass):
    name = "unmask-cache"
    description = "zero the cache columns of the additive attention_mask (test plugin, wrong on purpose)"
    after = "mask"
    idempotent = False

    def run(self, graph, ctx):
        mask = next((t for t in graph.inputs if t.name == "attention_mask"), None)
        cache = ctx.options.cache_len
        if mask is None or not cache:
            return PassResult()
        total = mask.shape[3]
        keep = (np.arange(total) >= cache).astype(np.float32).reshape(1, 1, 1, total)
        unmasked = gs.Variable("attention_mask/unmasked", mask.dtype, mask.shape)
        for node in list(mask.outputs):
            node.inputs[node.inputs.index(mask)] = unmasked
        graph.nodes.append(gs.Node("Mul", name="unmask-cache/Mul", outputs=[unmasked],
                                   inputs=[mask, gs.Constant("unmask-cache/keep", keep)]))
        return PassResult(rewrites=1)
