"""Compile options: one frozen, typed record, validated in one place for every source.

`build(layers)` is the only way in: each layer is the raw values of one source (the config
file, then the command line, or a dict given to the Python API) with the name of where each
value came from, so an error names the flag (`--seq-len`) or the config key
(`mtkc.toml:seq_len`). Later layers override earlier ones. Passes read `ctx.options.<field>`.

Bounds: lengths are capped at MAX_LEN = 2^17 tokens, the longest context the model families
mtkc targets (Qwen2.5, Llama 3.1: 128 K) support, and T x (C + T), the additive mask's size, at
2^31 elements (8 GiB in fp32): beyond that verify and generate would try to allocate it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from mtkc.errors import InputError

MAX_LEN = 1 << 17  # tokens (see the module docstring)
MAX_BATCH = 1024  # LLM graphs on the NPU run batch 1; beyond this a bound input is a typo, not a plan
MAX_ELEMENTS = 1 << 31  # one bound input: more elements cannot be indexed with int32
CACHE_IO = ("new", "sliding")
ROPE_MODES = ("table", "pos_emb")
EMBEDDINGS = ("host-input", "cpu")
PassOptionValue = str | int | float | bool


@dataclass(frozen=True)
class Options:
    """Every option of `check`/`compile` (None: not given; the pass or compile picks its default)."""

    sdk: str | None = None
    arch: str | None = None
    # shape binding
    seq_len: int | None = None
    cache_len: int | None = None
    batch: int | None = None
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # pipeline
    passes: tuple[str, ...] | None = None
    skip_passes: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    verify_each: bool = False
    pass_options: Mapping[str, Mapping[str, PassOptionValue]] = field(default_factory=lambda: MappingProxyType({}))
    # KV cache
    kv_cache: bool | None = None  # None: when the model has cache inputs
    cache_io: str = "new"
    chunks: int = 1
    # LLM blocks
    mask_value: float | None = None  # None: the I/O contract's default
    rope_mode: str | None = None  # None: compile picks the mode with the best placement
    embedding: str = "host-input"
    merge_gate_up: bool = False
    # partitions and converter
    min_partition_nodes: int | None = None
    force_cpu: tuple[str, ...] = ()
    force_npu: tuple[str, ...] = ()
    converter_cmd: str | None = None
    no_convert: bool = False
    converter_timeout: float | None = None  # seconds; None: the hand-off's default
    overwrite: bool = False
    # set per graph by compile's variant planner, never by a user
    variant: str | None = None
    chunk: int = 0
    max_positions: int | None = None

    def for_pass(self, name: str) -> Mapping[str, PassOptionValue]:
        """A plugin's own options (`[pass_options.<name>]` in the config)."""
        return self.pass_options.get(name, MappingProxyType({}))

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    def manifest(self) -> dict[str, Any]:
        """The options recorded in `manifest.json`: what shapes the output (not how it ran), as
        used; one left to a pass's own default (None) is not recorded."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in NOT_RECORDED and getattr(self, f.name) is not None}


# not in the manifest: the SDK is a top-level key; run-only switches; per-graph planner fields
NOT_RECORDED = ("sdk", "verify_each", "overwrite", "no_convert", "converter_timeout", "variant", "chunk", "max_positions")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# --- validation -------------------------------------------------------------------------------


def _int(low: int, high: int | None = None):
    expected = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"

    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            return None, expected
        return v, None
    return check


def _bool(v):
    return (v, None) if isinstance(v, bool) else (None, "true or false")


def _str(v):
    if isinstance(v, bool) or not isinstance(v, (str, int, float)) or (isinstance(v, str) and not v.strip()):
        return None, "a non-empty string"
    return str(v), None


def normalize_sdk(sdk: str) -> str:
    """'6', 'np6', 'v6.0', 'neuropilot-6.0' -> '6.0': the one spelling of a version (folder names, tables)."""
    text = str(sdk).strip().lower()
    for prefix in ("neuropilot-", "neuropilot", "np", "v"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return f"{text}.0" if text.isdigit() else text


def _sdk(v):
    text, expected = _str(v)
    return (None, expected) if expected else (normalize_sdk(text), None)


def _choice(*names: str):
    def check(v):
        return (v, None) if isinstance(v, str) and v in names else (None, f"one of {', '.join(names)}")
    return check


def _names(v):
    if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
        return None, "a list of names"
    return tuple(v), None


def _seconds(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
        return None, "a positive number of seconds"
    return float(v), None


def _mask_value(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v >= 0:
        return None, "a finite negative number (e.g. -100)"
    return float(v), None


def _shapes(v):
    expected = "a table of input name = [positive dims]"
    if not isinstance(v, Mapping):
        return None, expected
    out = {}
    for name, dims in sorted(v.items()):
        if not isinstance(name, str) or not name or not isinstance(dims, (list, tuple)) or not dims or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            return None, expected
        if math.prod(dims) > MAX_ELEMENTS:
            return None, f"{expected} of at most 2^31 elements per input ('{name}' has {math.prod(dims)})"
        out[name] = tuple(dims)
    return MappingProxyType(out), None


def _pass_options(v):
    expected = "a table of [pass_options.<pass name>] tables of strings, numbers or booleans"
    if not isinstance(v, Mapping) or not all(isinstance(t, Mapping) for t in v.values()):
        return None, expected
    for table in v.values():
        for value in table.values():
            if not isinstance(value, (str, int, float, bool)) or (isinstance(value, float) and not math.isfinite(value)):
                return None, expected
    return MappingProxyType({name: MappingProxyType(dict(t)) for name, t in sorted(v.items())}), None


CHECKS = {
    "sdk": _sdk,
    "arch": _str,
    "seq_len": _int(1, MAX_LEN),
    "cache_len": _int(1, MAX_LEN),
    "batch": _int(1, MAX_BATCH),
    "input_shapes": _shapes,
    "passes": _names,
    "skip_passes": _names,
    "plugins": _names,
    "verify_each": _bool,
    "pass_options": _pass_options,
    "kv_cache": _bool,
    "cache_io": _choice(*CACHE_IO),
    "chunks": _int(1, MAX_LEN),
    "mask_value": _mask_value,
    "rope_mode": _choice(*ROPE_MODES),
    "embedding": _choice(*EMBEDDINGS),
    "merge_gate_up": _bool,
    "min_partition_nodes": _int(1),
    "force_cpu": _names,
    "force_npu": _names,
    "converter_cmd": _str,
    "no_convert": _bool,
    "converter_timeout": _seconds,
    "overwrite": _bool,
    # planner keys: accepted from the Python API only
    "variant": _choice("prefill", "decode"),
    "chunk": _int(0, MAX_LEN),
    "max_positions": _int(1, 2 * MAX_LEN),
}
PLANNER_KEYS = ("variant", "chunk", "max_positions")
USER_KEYS = tuple(k for k in CHECKS if k not in PLANNER_KEYS)

# where a value came from -> how an error names the key: source(key) -> "--seq-len" / "mtkc.toml:seq_len"
FLAGS = {"input_shapes": "--input-shape", "skip_passes": "--skip-pass", "plugins": "--plugin"}


def cli_flag(key: str) -> str:
    return FLAGS.get(key, "--" + key.replace("_", "-"))


@dataclass(frozen=True)
class Layer:
    """The raw values of one source; `where(key)` names a key in messages."""

    values: Mapping[str, Any]
    source: str  # "cli", "api", or the config file's description (e.g. "mtkc.toml")

    def where(self, key: str) -> str:
        if self.source == "cli":
            return cli_flag(key)
        if self.source == "api":
            return f"option '{key}'"
        return f"{self.source}:{key}"


def build(layers: Iterable[Layer]) -> Options:
    """Options from sources in increasing priority; a value of None means "not given there"."""
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for layer in layers:
        for key, raw in layer.values.items():
            if raw is None:
                continue
            check = CHECKS.get(key)
            if check is None or (key in PLANNER_KEYS and layer.source != "api"):
                raise InputError(f"{layer.where(key)}: unknown option; known: {', '.join(USER_KEYS)}")
            value, expected = check(raw)
            if expected is not None:
                raise InputError(f"{layer.where(key)}: expected {expected}, got {_shown(raw)}")
            values[key] = value
            where[key] = layer.where(key)
    seq, cache = values.get("seq_len"), values.get("cache_len")
    if seq and cache and seq * (seq + cache) > MAX_ELEMENTS:
        raise InputError(f"{where['seq_len']} {seq} with {where['cache_len']} {cache}: the attention mask "
                         f"[T, C+T] would hold {seq * (seq + cache)} elements (at most 2^31)")
    return Options(**values)


def of(options: Options | Mapping[str, Any] | None) -> Options:
    """Options as given to the Python API: an Options, or a dict validated like the CLI's."""
    if isinstance(options, Options):
        return options
    return build([Layer(dict(options or {}), "api")])


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_tolerances(atol: float, rtol: float, min_cosine: float) -> None:
    """`verify`'s tolerances: atol and rtol finite and >= 0, the minimum cosine in -1..1."""
    for flag, value in (("--atol", atol), ("--rtol", rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise InputError(f"{flag}: expected a finite number >= 0, got {value}")
    if not -1 <= min_cosine <= 1:  # False for NaN too
        raise InputError(f"--min-cosine: expected a number in -1..1, got {min_cosine}")
