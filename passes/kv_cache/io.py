"""`kv-cache-io`: the present outputs the runtime keeps, and the contract order of graph I/O.

    new      present_<kv>_<i> = the concat's `new` input      [1,Hkv,T,D] (runtime writes it in)
    sliding  present_<kv>_<i> = Slice(concat, T:C+T, axis 2)  [1,Hkv,C,D] (runtime feeds it back)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.contract import cache as layouts
from mtkc.contract import io as contract_io
from mtkc.errors import InputError
from mtkc.ir.graph_utils import Names as NodeNames, cleanup
from mtkc.analysis.cache import KINDS, layer_caches
from mtkc.passes.kv_cache.plan import cache_options, kv_on
from mtkc.rewrite.pass_api import Context, Pass, PassResult, register


@register
class KvCacheIo(Pass):
    name = "kv-cache-io"
    description = "present_* outputs: new entries [1,Hkv,T,D] (cache_io=new) or the slid cache [1,Hkv,C,D]"
    before = ("layer-chunks",)
    changes_io = True  # also drops inputs that became unused and puts the I/O in contract order

    def applies(self, ctx: Context) -> bool:
        return kv_on(ctx.options)

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        t, c, mode = cache_options(ctx.options)
        outputs = {o.name: o for o in graph.outputs}
        position = {o.name: i for i, o in enumerate(graph.outputs)}  # list.index per layer is quadratic
        names = NodeNames(graph)
        inputs = {t.name for t in graph.inputs}  # `in graph.inputs` compares names, one by one
        rewrites = 0
        for layer in layer_caches(graph, ctx.analysis(decoder_map, graph)):
            for kind in KINDS:
                name = f"present_{kind}_{layer.index}"
                concat = layer.concat[kind]
                full = concat.outputs[0]
                _, hkv, _, d = layer.past[kind].shape
                dtype = layer.past[kind].dtype or np.float32  # an fp16 export keeps an fp16 cache
                if outputs.get(name) is not full:
                    continue  # already rewritten, or a chunk without this layer
                full.name = f"kv_{kind}_{layer.index}"
                if mode == "new":
                    present = concat.inputs[1]
                    if present.name in inputs or isinstance(present, gs.Constant):
                        raise InputError(f"{full.name}: the new {kind} entries are not computed by the graph")
                else:
                    present = gs.Variable(name, dtype, [1, hkv, c, d])
                    graph.nodes.append(gs.Node(
                        "Slice", names.new(f"kv_cache/slide_{kind}_{layer.index}"),
                        inputs=[full] + [gs.Constant(names.new(f"kv_cache/{n}_{kind}_{layer.index}"),
                                                     np.array([v], np.int32))
                                         for n, v in (("start", t), ("end", t + c), ("axis", 2))],
                        outputs=[present]))
                present.name = name
                present.dtype = dtype
                present.shape = [1, hkv, t if mode == "new" else c, d]
                graph.outputs[position[name]] = present
                rewrites += 1
        cleanup(graph, unused_inputs=True)  # e.g. new_token_mask once its Shape folded
        contract_order(graph)
        return PassResult(rewrites=rewrites)

    def map_outputs(self, outputs, ctx):
        t, c, mode = cache_options(ctx.options)
        mapped = {}
        for name, value in outputs.items():
            if name.startswith("present_"):
                value = layouts.from_outputs(value, mode, t, c)
            mapped[name] = value
        return mapped




def contract_order(graph: gs.Graph) -> None:
    """Graph I/O in contract order: tokens/hidden, mask, positions, then per layer key, value."""
    graph.inputs = sorted(graph.inputs, key=lambda t: contract_io.order_key(t.name))
    graph.outputs = sorted(graph.outputs, key=lambda t: contract_io.order_key(t.name))


