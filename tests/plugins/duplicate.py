"""A plugin registering a name a built-in already has."""

from mtkc.rewrite.pass_api import Pass, register


@register
class Fold(Pass):
    name = "fold"
