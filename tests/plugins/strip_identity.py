"""A well-behaved plugin pass: bypass Identity nodes (numerically neutral, idempotent)."""

from mtkc.rewrite.pass_api import Pass, PassResult, register


@register
class StripIdentity(Pass):
    name = "strip-identity"
    description = "bypass Identity nodes (test plugin)"
    after = "fold"

    def run(self, graph, ctx):
        outputs = {id(t) for t in graph.outputs}
        rewrites = 0
        for node in list(graph.nodes):
            if node.op != "Identity" or id(node.outputs[0]) in outputs:
                continue
            src, dst = node.inputs[0], node.outputs[0]
            for consumer in list(dst.outputs):
                for i, t in enumerate(consumer.inputs):
                    if t is dst:
                        consumer.inputs[i] = src
            node.outputs.clear()
            rewrites += 1
        return PassResult(rewrites=rewrites)
