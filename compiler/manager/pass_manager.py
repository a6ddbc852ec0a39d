"""The pass manager: which passes exist, which run, in what order, and what each one did.

Registry:  built-ins (every module of the package `Builtins` names, imported in name order: mtkc's
           own, `mtkc.pipeline.registry`, so the manager imports no pass), third-party
           passes from the `mtkc.passes` entry-point group (listed always, run only when
           enabled by `--plugin NAME`, config `plugins`, or named in `--passes`), and
           `--plugin FILE.py|module` (its `@register`ed passes run by default).
Pipeline:  `--passes` (exact list) or the SDK's default list plus enabled plugin passes,
           minus `--skip-pass`; passes whose `applies(ctx)` is false are skipped and reported.
Running:   after each pass the graph invariants are restored and checked (`mtkc.manager.invariants`);
           per-pass stats are kept; `--verify-each` compares with the input model after every
           pass that changed the graph (`mtkc.manager.verify_each`).
A plugin that fails to import, registers a bad name, or raises is a PassError naming it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import pkgutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import onnx_graphsurgeon as gs

from mtkc.errors import InputError, MtkcError, PassError
from mtkc.ir import shapes
from mtkc.ir.graph_utils import tensor_map
from mtkc.manager import invariants
from mtkc.manager.guard import guarded, one_line
from mtkc.manager.verify_each import EachVerifier
from mtkc.rewrite.pass_api import REGISTRY, Context, Miss, Pass, PassResult, collecting, describe

log = logging.getLogger("mtkc.passes")

ENTRY_POINT_GROUP = "mtkc.passes"


# --- registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Builtins:
    """Where the built-in passes are: a package whose every module registers passes, and the
    default pipeline (pass names) per SDK version."""

    package: ModuleType
    default: Callable[[str | None], list[str]]


@dataclass
class Registry:
    """Every known pass by name; `enabled` are plugin passes that join the default pipeline."""

    passes: dict[str, type[Pass]]
    entry_points: dict[str, importlib.metadata.EntryPoint] = field(default_factory=dict)
    enabled: list[str] = field(default_factory=list)
    default: Callable[[str | None], list[str]] = lambda sdk: []  # the default pipeline per SDK

    def names(self) -> list[str]:
        return list(self.passes) + [n for n in self.entry_points if n not in self.passes]

    def get(self, name: str) -> type[Pass]:
        if name not in self.passes:
            if name not in self.entry_points:
                raise InputError(f"unknown pass '{name}'; available: {', '.join(sorted(self.names()))}")
            self.passes[name] = _load_entry_point(self.entry_points[name])
        return self.passes[name]


def load_registry(plugins: list[str] | tuple[str, ...], builtins: Builtins) -> Registry:
    """Built-ins, discovered entry points, and the given plugins (files or modules or EP names)."""
    passes = dict(builtin_passes(builtins))
    eps = {}
    for ep in _entry_points():
        if ep.name in passes:
            raise PassError(
                f"pass name '{ep.name}' is registered twice: by {describe(passes[ep.name])} and by {_ep_origin(ep)}"
            )
        eps[ep.name] = ep
    registry = Registry(passes, eps, default=builtins.default)
    for spec in plugins:
        if spec in eps and not spec.endswith(".py"):
            registry.get(spec)
            registry.enabled.append(spec)
            continue
        for name, cls in load_plugin(spec).items():
            other = passes.get(name) or (eps[name] if name in eps else None)
            if other is not None and other is not cls:
                first = describe(other) if isinstance(other, type) else _ep_origin(other)
                raise PassError(f"pass name '{name}' is registered twice: by {first} and by {describe(cls)}")
            passes[name] = cls
            if name not in registry.enabled:
                registry.enabled.append(name)
    return registry


@functools.cache
def builtin_passes(builtins: Builtins) -> dict[str, type[Pass]]:
    """Import every module of the built-ins' package (name order); its passes, in module then definition order."""
    package = builtins.package
    modules = [
        f"{package.__name__}.{info.name}"
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)
        if info.name != "pipelines"
    ]
    for module in modules:
        try:
            importlib.import_module(module)
        except MtkcError:
            raise
        except (Exception, SystemExit) as exc:  # sys.exit() in a plugin is its failure, not mtkc's exit
            raise PassError(f"built-in pass module {module} failed to import: {one_line(exc)}") from None
    rank = {module: i for i, module in enumerate(modules)}
    top = lambda cls: ".".join(cls.__module__.split(".")[:3])  # noqa: E731 -- a subpackage's modules
    builtins = [(name, cls) for name, cls in REGISTRY.items() if top(cls) in rank]
    return dict(sorted(builtins, key=lambda item: (rank[top(item[1])], item[1].__module__)))


@functools.cache
def load_plugin(spec: str) -> dict[str, type[Pass]]:
    """Import a plugin file (`x.py`) or module once; returns the passes it registered."""
    is_file = spec.endswith(".py") or Path(spec).is_file()
    origin = f"plugin {spec}"
    with collecting(origin) as found:
        try:
            if is_file:
                path = Path(spec)
                if not path.is_file():
                    raise PassError(f"{origin}: no such file")
                module_name = f"mtkc_plugin_{path.stem}"
                loader_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[module_name] = module
                loader_spec.loader.exec_module(module)
            else:
                importlib.import_module(spec)
        except MtkcError:
            raise
        except (Exception, SystemExit) as exc:  # sys.exit() in a plugin is its failure, not mtkc's exit
            raise PassError(f"{origin} failed to import: {one_line(exc)}") from None
    if not found:
        raise PassError(f"{origin} registers no pass (decorate a Pass subclass with @mtkc.rewrite.pass_api.register)")
    return dict(found)


@functools.cache
def _entry_points() -> tuple[importlib.metadata.EntryPoint, ...]:
    return tuple(sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name))


def _ep_origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type[Pass]:
    origin = _ep_origin(ep)
    with collecting(origin):
        try:
            cls = ep.load()
        except MtkcError:
            raise
        except (Exception, SystemExit) as exc:  # sys.exit() in a plugin is its failure, not mtkc's exit
            raise PassError(f"pass '{ep.name}' ({origin}) failed to load: {one_line(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Pass)) or cls.name != ep.name:
        raise PassError(f"entry point '{ep.name}' ({origin}) must name a Pass subclass whose name is '{ep.name}'")
    cls.origin = origin
    return cls


# --- pipeline -------------------------------------------------------------------------------


@dataclass
class Pipeline:
    passes: list[Pass]
    skipped: list[tuple[str, str]]  # (name, why) for passes not run
    bind: type[Pass] | None = None  # the registry's `bind-shapes`: --verify-each binds its inputs with it

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]


def resolve_pipeline(
    registry: Registry,
    ctx: Context,
    passes: list[str] | None = None,
    skip: list[str] | tuple[str, ...] = (),
) -> Pipeline:
    """The passes to run: `passes` exactly, or the SDK default plus enabled plugins; minus `skip`."""
    for name in [*(passes or []), *skip]:
        registry.get(name)  # unknown -> InputError listing the available passes
    skipped: list[tuple[str, str]] = []
    if passes is not None:
        names = list(passes)
    else:
        names = []
        for name in registry.default(ctx.sdk):
            if name not in registry.passes:
                raise InputError(f"default pipeline: pass '{name}' is not registered; "
                                 f"passes: {', '.join(sorted(registry.names()))}")
            names.append(name)
        for name in registry.enabled:
            after = registry.get(name).after
            if after is not None and after not in registry.names():
                raise InputError(f"pass '{name}' ({registry.get(name).origin}): after = {after!r} names no pass; "
                                 f"passes: {', '.join(sorted(registry.names()))}")
            if name in names:
                continue
            names.insert(names.index(after) + 1 if after in names else len(names), name)
    chosen: list[Pass] = []
    for name in names:
        if name in skip:
            skipped.append((name, "--skip-pass"))
            continue
        instance = guarded(registry.get(name), "create", registry.get(name))
        if not guarded(instance, "applies", instance.applies, ctx):
            skipped.append((name, f"does not apply to SDK {ctx.sdk}"))
            continue
        chosen.append(instance)
    _check_order(registry, chosen)
    return Pipeline(chosen, skipped, registry.passes.get("bind-shapes"))


def _check_order(registry: Registry, chosen: list[Pass]) -> None:
    """Every declared `requires` / `before` / `after` of the chosen passes holds (else InputError)."""
    at = {p.name: i for i, p in enumerate(chosen)}
    for i, p in enumerate(chosen):
        where = f"pass '{p.name}' ({p.origin})"
        for kind, names in (("requires", p.requires), ("before", p.before), ("after", (p.after,) if p.after else ())):
            for name in names:
                if name not in registry.names():
                    raise InputError(f"{where}: {kind} {name!r} names no pass; "
                                     f"passes: {', '.join(sorted(registry.names()))}")
                if kind == "requires" and at.get(name, i) >= i:
                    raise InputError(f"{where} requires '{name}' to run before it, "
                                     f"{'later in' if name in at else 'absent from'} the pipeline")
                if kind == "before" and at.get(name, i + 1) < i:
                    raise InputError(f"{where} must run before '{name}', which comes first in the pipeline")
                if kind == "after" and at.get(name, -1) > i:
                    raise InputError(f"{where} must run after '{name}', which comes later in the pipeline")


# --- running --------------------------------------------------------------------------------


@dataclass
class PassRecord:
    """What one pass did: the manifest's `passes[]` entry plus misses/notes for reports."""

    name: str
    origin: str
    rewrites: int
    nodes_before: int
    nodes_after: int
    seconds: float
    misses: list[Miss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    graph: str = "model"  # the variant it ran on (prefill/decode/...)
    host: dict = field(default_factory=dict)  # PassResult.host: tables the host supplies

    def stats(self) -> dict:
        return {
            "graph": self.graph,
            "name": self.name,
            "rewrites": self.rewrites,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }


def run_pipeline(
    graph: gs.Graph,
    pipeline: Pipeline,
    ctx: Context,
    verify_each: bool = False,
    seed: int = 0,
    observe: Callable[[Pass, gs.Graph, bool], None] | None = None,
) -> list[PassRecord]:
    """Run the passes in place on `graph`; restore/check invariants after each; return stats.

    `observe(pass, graph, touched)` is called after each pass (invariants restored), e.g. to track
    nodes; it must not change the graph. `touched` is False when the graph is as the pass found it:
    a built-in pass that rewrote nothing, kept every node and typed no tensor.
    """
    sweep = invariants.restore(graph, None, InputError)
    if sweep is None or not sweep.sound:
        invariants.check(graph, None, error=InputError)
    if sweep is None or sweep.mixed:
        invariants.check_dtypes(graph, None, InputError)
    verifier = EachVerifier(graph, ctx, seed, pipeline.bind) if verify_each else None
    records = []
    contract = invariants.io_contract(graph)  # names, dtypes, shapes of graph inputs/outputs
    after = sweep and sweep.loose  # loose tensors after the previous pass, when known (nothing below edits the graph)
    for p in pipeline.passes:
        nodes_before = len(graph.nodes)
        members = list(map(id, graph.nodes))
        loose = after if after is not None else invariants.loose_tensors(graph)
        start = time.perf_counter()
        result = guarded(p, "run", p.run, graph, ctx)
        if not isinstance(result, PassResult):
            raise PassError(f"pass '{p.name}' ({p.origin}) returned {type(result).__name__}, not a PassResult")
        if result.changed or len(graph.nodes) != nodes_before:
            ctx.analyses.invalidate(graph, tuple(p.preserves))
        if verify_each or p.origin != "built-in" or result.changed or list(map(id, graph.nodes)) != members:
            sweep = invariants.restore(graph, p.name)
            after = None
            if invariants.shapes_bound(graph):
                after = sweep.loose if sweep is not None else invariants.loose_tensors(graph)
            if after is not None and invariants.new_loose(after, loose):
                _fill_types(graph, ctx.root)  # type what the pass left untyped; still loose -> PassError
                after, sweep = invariants.loose_tensors(graph), None
            if sweep is None or not sweep.sound:  # else `check` would only look for new loose tensors: none
                invariants.check(graph, p.name, loose, loose_now=after)
            contract = invariants.check_io(graph, p, contract)  # undeclared I/O change -> PassError (the
            if sweep is None or sweep.mixed:                    # cause of a dtype mix it would also leave)
                invariants.check_dtypes(graph, p)
            touched = True
        else:  # a built-in pass that rewrote nothing kept the nodes as they were (it may have typed tensors)
            after = invariants.loose_tensors(graph)  # what the next pass starts from (`loose`) in any case
            touched = after != loose
            contract = invariants.check_io(graph, p, contract)
        record = PassRecord(
            p.name, p.origin, result.rewrites, nodes_before, len(graph.nodes),
            time.perf_counter() - start, list(result.misses), list(result.notes), host=dict(result.host),
        )
        records.append(record)
        log.debug(
            "%-16s %4d rewrites  nodes %5d -> %5d  %.3fs%s",
            p.name, record.rewrites, record.nodes_before, record.nodes_after, record.seconds,
            f"  ({len(record.misses)} misses)" if record.misses else "",
        )
        if verifier is not None:
            verifier.after(p, graph, result.changed)
        if observe is not None:
            observe(p, graph, touched)
    return records


def _fill_types(graph: gs.Graph, root) -> None:
    """ONNX shape inference for tensors without dtype/static shape; known ones are kept as they are."""
    known = {
        id(t): (t.dtype, t.shape)
        for t in tensor_map(graph).values()
        if isinstance(t, gs.Variable) and t.dtype is not None and invariants.static(t)
    }
    shapes.infer(graph, root)
    for t in tensor_map(graph).values():
        if id(t) in known:
            t.dtype, t.shape = known[id(t)]
