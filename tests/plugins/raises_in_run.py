"""A plugin pass that crashes while running."""

from mtkc.rewrite.pass_api import Pass, register


@register
class Crash(Pass):
    name = "crash-in-run"
    description = "raises (test plugin)"

    def run(self, graph, ctx):
        raise RuntimeError("boom from the plugin")
