"""A plugin registering a pass whose name is not kebab-case."""

from mtkc.rewrite.pass_api import Pass, register


@register
class BadName(Pass):
    name = "Bad_Name"
