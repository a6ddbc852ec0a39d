"""A plugin pass that breaks an invariant: it removes the producer of a used tensor."""

from mtkc.rewrite.pass_api import Pass, PassResult, register


@register
class Dangle(Pass):
    name = "drop-producer"
    description = "detach the last node from the graph but keep its output in use (test plugin)"

    def run(self, graph, ctx):
        node = graph.nodes[-1]
        graph.nodes.remove(node)
        node.outputs[0].inputs.clear()
        return PassResult(rewrites=1)
