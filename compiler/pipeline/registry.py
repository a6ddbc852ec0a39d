"""mtkc's pass registry: the pass manager's, with the built-in passes of `mtkc.passes` and their
default pipelines (`mtkc.passes.pipelines`). The manager imports no pass; this is where mtkc
tells it which are built in."""

from __future__ import annotations

from mtkc import passes
from mtkc.manager import pass_manager
from mtkc.passes.pipelines import default_pipeline
from mtkc.rewrite.pass_api import Pass

BUILTINS = pass_manager.Builtins(passes, default_pipeline)


def load_registry(plugins: list[str] | tuple[str, ...] = ()) -> pass_manager.Registry:
    """Built-ins, discovered entry points and the given plugins (`pass_manager.load_registry`)."""
    return pass_manager.load_registry(plugins, BUILTINS)


def builtin_passes() -> dict[str, type[Pass]]:
    """mtkc's built-in passes by name, in module then definition order."""
    return pass_manager.builtin_passes(BUILTINS)
