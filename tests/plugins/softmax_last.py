"""A plugin pass that edits a node in place: Softmax over axis 1 of a rank-3 input becomes
Softmax over the last axis (the same node object, only its attribute changed; a test of what
`mtkc check` attributes to it, not a numerically neutral rewrite)."""

from mtkc.rewrite.pass_api import Pass, PassResult, register


@register
class SoftmaxLast(Pass):
    name = "softmax-last"
    description = "Softmax axis -> -1, in place (test plugin)"

    def run(self, graph, ctx):
        rewrites = 0
        for node in graph.nodes:
            if node.op == "Softmax" and node.attrs.get("axis", -1) != -1:
                node.attrs["axis"] = -1
                rewrites += 1
        return PassResult(rewrites=rewrites)
