"""The Pass API: what a rewrite pass is, and the context it runs in.

A pass has a unique kebab-case `name`, a one-line `description`, `applies(ctx)` (SDK, options)
and `run(graph, ctx) -> PassResult`. Register built-ins and plugins with `@register`.
Rewrites report the sites that did not match (`PassResult.misses`) with the first failing
condition, so `mtkc compile --explain PASS` can say why without reading code.

    @register
    class FuseFoo(Pass):
        name = "fuse-foo"
        description = "Foo+Bar -> FooBar"

        def run(self, graph, ctx):
            ...
            return PassResult(rewrites=n, misses=[Miss(node.name, "Bar has two consumers")])

Most passes are rewrite rules instead (`mtkc.rewrite.rules`: anchor, pattern, check, rewrite),
and the rule driver fills in `PassResult`.

The pass manager owns the graph's invariants: after `run` it removes dead nodes, sorts
topologically, names unnamed/duplicate nodes `<pass>/<op or old name>`, re-infers shapes when
a pass left new tensors untyped, and checks that no tensor dangles and every tensor is typed
(static once shapes are bound). Build new nodes with `mtkc.rewrite.builder.Emit` (or name them
with `mtkc.ir.graph_utils.Names`) to keep names readable.

A pass that changes the graph's I/O contract (a mask/RoPE/KV-cache normalisation replaces
inputs or outputs) overrides `map_feeds` / `map_outputs`, so `--verify-each` can feed the
rewritten graph and compare it with the input model. Both are called on the same instance
after its `run`, so `run` may record what it replaced on `self`.
Tables the host must supply afterwards (an embedding moved out of the graph, RoPE rows) are
returned in `PassResult.host`; nothing outside the pass reads its attributes.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.errors import PassError
from mtkc.options import Options
from mtkc.options import of as options_of
from mtkc.rewrite.table import CapabilityTable

NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass
class Miss:
    """A candidate site a rewrite looked at and refused, with the first failing condition.
    `node` is the node or its name."""

    node: str
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.node, str):
            self.node = getattr(self.node, "name", None) or str(self.node)


@dataclass
class PassResult:
    """What a pass did. `host`: tables it moved out of the graph for the host to supply
    (name -> array, or the weight `gs.Constant` itself, read only when written)."""

    rewrites: int = 0
    misses: list[Miss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.rewrites > 0


class Analyses:
    """Analyses cached per graph (`ctx.analysis(decoder_map, graph)`): computed once, kept until a
    pass that changed the graph and does not list the analysis in its `preserves` has run."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str], tuple[gs.Graph, Any]] = {}
        self.computed: dict[str, int] = {}  # analysis name -> times computed (for tests and stats)

    def get(self, analysis: Callable[[gs.Graph], Any], graph: gs.Graph) -> Any:
        key = (id(graph), analysis.__name__)
        if key not in self._cache or self._cache[key][0] is not graph:
            self._cache[key] = (graph, analysis(graph))
            self.computed[analysis.__name__] = self.computed.get(analysis.__name__, 0) + 1
        return self._cache[key][1]

    def invalidate(self, graph: gs.Graph, keep: tuple[str, ...] = ()) -> None:
        for key in [k for k in self._cache if k[0] == id(graph) and k[1] not in keep]:
            del self._cache[key]


@dataclass
class Context:
    """What a pass may consult: the target table, the typed compile options, how to read a weight.

    `options` is a `mtkc.options.Options` (a dict is validated into one, for tests and the API).
    `table` is None when a pass runs without a target (unit tests; `NullTable` is the explicit
    permissive stand-in).
    """

    table: CapabilityTable | None
    options: Options = field(default_factory=Options)
    root: Path | None = None  # folder of the source model's external data
    read_values: Callable[[gs.Constant], Any] | None = None
    analyses: Analyses = field(default_factory=Analyses, repr=False, compare=False)
    renamed: dict[str, str] = field(default_factory=dict)  # graph input name a pass gave -> the model's name

    def model_name(self, name: str) -> str:
        """The model's own name of graph input `name` (what a user can pass to --input-shape)."""
        return self.renamed.get(name, name)

    def __post_init__(self) -> None:
        self.options = options_of(self.options)

    def analysis(self, analysis: Callable[[gs.Graph], Any], graph: gs.Graph) -> Any:
        """`analysis(graph)`, cached until a pass changes the graph (see `Analyses`)."""
        return self.analyses.get(analysis, graph)

    @property
    def sdk(self) -> str:
        return self.table.version


class Pass:
    """Base class for rewrite passes. Subclasses set `name`, `description`, implement `run`.

    Class attributes a pass may set:
      idempotent  False if running it twice may rewrite again (the idempotency test skips it)
      after       for plugin passes: the pass after which it runs in the default pipeline
                  (appended at the end when unset or absent)
      changes_io  True if it may change graph inputs/outputs (names, dtypes, shapes) without
                  overriding map_feeds/map_outputs; else the manager refuses such a change
      requires    passes that must run earlier in the same pipeline whenever this one runs
      before      passes this one must precede when both are in the pipeline (`after` likewise,
                  one name); checked when the pipeline is resolved (a violation is exit 2)
      preserves   names of the analyses (`ctx.analysis`) still valid after this pass changed the graph
    `origin` is filled in by the registry: "built-in", "plugin <file or module>",
    or "<distribution> <version>" for an entry point.
    """

    name: str = ""
    description: str = ""
    origin: str = "built-in"
    idempotent: bool = True
    after: str | None = None
    changes_io: bool = False
    requires: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    preserves: tuple[str, ...] = ()

    def applies(self, ctx: Context) -> bool:
        return True

    def run(self, graph: gs.Graph, ctx: Context) -> PassResult:
        raise NotImplementedError

    def map_feeds(self, feeds: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
        """Inputs for the graph before this pass -> inputs for the graph after it (default: same)."""
        return feeds

    def map_outputs(self, outputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
        """Expected outputs before this pass -> expected outputs after it (default: same)."""
        return outputs


REGISTRY: dict[str, type[Pass]] = {}

_sink: dict[str, type[Pass]] | None = None  # set while a plugin is being loaded
_origin = "built-in"


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator adding a pass to the registry (name must be unique and kebab-case)."""
    where = f"{_origin} ({cls.__module__}.{cls.__qualname__})"
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise PassError(f"{where}: @register needs a subclass of mtkc.rewrite.pass_api.Pass")
    if not isinstance(cls.name, str) or not NAME_RE.match(cls.name):
        raise PassError(f"{where}: pass name {cls.name!r} is not kebab-case")
    target = REGISTRY if _sink is None else _sink
    other = target.get(cls.name) or REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise PassError(f"pass name '{cls.name}' is registered twice: by {describe(other)} and by {where}")
    cls.origin = _origin
    target[cls.name] = cls
    return cls


def describe(cls: type[Pass]) -> str:
    """Origin and defining class of a registered pass, for messages."""
    return f"{cls.origin} ({cls.__module__}.{cls.__qualname__})"


@contextmanager
def collecting(origin: str) -> Iterator[dict[str, type[Pass]]]:
    """Route `@register` into a fresh dict tagged with `origin` (used to load one plugin)."""
    global _sink, _origin
    saved = _sink, _origin
    _sink, _origin = {}, origin
    try:
        yield _sink
    finally:
        _sink, _origin = saved

