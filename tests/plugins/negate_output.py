"""A deliberately wrong plugin pass: negates the first graph output (changes the numbers)."""

import onnx_graphsurgeon as gs

from mtkc.rewrite.pass_api import Pass, PassResult, register


@register
class NegateOutput(Pass):
    name = "negate-output"
    description = "flip the sign of the first output (test plugin, wrong on purpose)"
    idempotent = False

    def run(self, graph, ctx):
        out = graph.outputs[0]
        producer = out.inputs[0]
        inner = gs.Variable(f"{out.name}/pre-negate", out.dtype, out.shape)
        producer.outputs[producer.outputs.index(out)] = inner
        graph.nodes.append(gs.Node("Neg", name="negate-output/Neg", inputs=[inner], outputs=[out]))
        return PassResult(rewrites=1)
