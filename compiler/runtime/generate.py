"""Reference host runtime: greedy generation through compiled prefill / decode graphs.

What a device runtime does around MediaTek's LLM graphs, in numpy + onnxruntime, wired by
`manifest.json`: host-side inputs (additive mask, positions or cos/sin `pos_emb` rows, embedding
rows when the graph takes `hidden_states`: tables listed in the manifest's `host`), the KV
cache, and the prefill -> decode hand-over.

    prompt ──► prefill (T tokens per call; a short tail is padded and masked) ──► argmax
           ──► decode (1 token per call) ──► argmax ──► ... until max_new_tokens or the cache is full

A compile without KV cache (one static `model` graph of T tokens) runs the whole sequence, padded
to T, once per new token, until T tokens are in it.

Cache: C slots per layer, `valid[C]` says which hold a token. `cache_io="new"`: graphs return
the T new entries and the runtime writes the valid ones at the next free slots; `"sliding"`:
graphs return `concat(past, new)[T:]`, which is fed back as is (valid slides with it).
Chunks (`prefill_0..N-1`) run in order; an input the manifest wires `from` an earlier graph's output
(chunk k's `hidden_states` from chunk k-1's `hidden_states_out`) is fed that output.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort

from mtkc.contract import cache as layouts
from mtkc.contract import io, mask, positions
from mtkc.errors import ExternalDataError, InputError
from mtkc.ir.copier import copy_error
from mtkc.ir.model import ExternalValues, external_info
from mtkc.ir.model_checks import external_fields, external_size, open_external
from mtkc.ir.outdir import check_graph_file, confined, load_table, read_manifest
from mtkc.ir.weights import WeightWriter
from mtkc.options import Layer, build
from mtkc.runtime.sessions import Sessions

log = logging.getLogger("mtkc")

_NAME = re.compile(r"^(prefill|decode)(?:_(\d+))?$")


@dataclass
class Stage:
    """One graph (one chunk of prefill or decode) and its I/O."""

    name: str
    session: ort.InferenceSession
    inputs: dict[str, tuple[type, list[int]]]
    outputs: list[str]
    sources: dict[str, tuple[str, str]]  # input -> (graph, output) it is wired from (manifest `from`)

    @property
    def tokens(self) -> int:
        for name in (io.INPUT_IDS, io.HIDDEN_STATES, io.POSITION_IDS, io.POS_EMB):
            if name in self.inputs:
                return self.inputs[name][1][2 if name == io.POS_EMB else 1]
        raise InputError(f"graph '{self.name}': no input_ids / hidden_states / position_ids input")


class Generator:
    """Greedy decoding over the graphs a KV-cache compile wrote to `out_dir`."""

    def __init__(self, out_dir: str | Path, mask_value: float | None = None, sessions: Sessions | None = None):
        self.root = Path(out_dir)
        path = self.root / "manifest.json"
        manifest = read_manifest(self.root)  # shape checked, every path confined to OUT
        options = manifest.get("options") or {}
        given = Layer({"mask_value": mask_value}, "cli") if mask_value is not None else \
            Layer({"mask_value": options.get("mask_value")}, f"{path}:options")
        self.mask_value = mask.value_of(build([given]))  # validated as compile's --mask-value is
        self.sessions = sessions or Sessions(self.root)  # weights mapped once for every graph (and generator)
        stages: dict[str, list[tuple[int, Stage]]] = {"prefill": [], "decode": []}
        graphs = manifest.get("graphs", [])
        for graph in graphs:
            m = _NAME.match(graph["name"])
            if m:
                stages[m[1]].append((int(m[2] or 0), self._stage(graph)))
        self.full = [g["name"] for g in graphs] == ["model"]  # no KV cache: the whole sequence per token
        if self.full:
            stages = {"prefill": [(0, self._stage(graphs[0]))], "decode": []}
        elif not stages["prefill"] or not stages["decode"]:
            raise InputError(f"{path}: no prefill/decode graphs; compile a KV-cache model (--kv-cache)")
        self.prefill = [s for _, s in sorted(stages["prefill"], key=lambda x: x[0])]
        self.decode = [s for _, s in sorted(stages["decode"], key=lambda x: x[0])]
        if self.full:
            self._no_cache()
        else:
            self._layout(options.get("cache_io"))
        first = self.prefill[0].inputs
        self.embedding = self._host(manifest, "embedding", "graphs take hidden_states") if io.HIDDEN_STATES in first else None
        self.rope = self._host(manifest, "rope", "graphs take pos_emb") if io.POS_EMB in first else None
        self.vocab = _vocab(self.embedding, self.prefill[-1])
        self.stop_reason: str | None = None

    def _stage(self, graph: dict) -> Stage:
        path = confined(self.root, graph["path"], f"graph '{graph['name']}'")
        check_graph_file(path)  # weights inside OUT and within weights.bin, before onnxruntime reads them
        try:
            session = self.sessions.get(path)
        except Exception as exc:  # onnxruntime's own errors: the file was not written by this mtkc, or edited
            raise InputError(f"{path}: does not load in onnxruntime ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        inputs = {}
        for x in session.get_inputs():
            if not all(isinstance(d, int) for d in x.shape):
                raise InputError(f"{path}: input '{x.name}' has a dynamic shape {x.shape}")
            inputs[x.name] = (io.ort_dtype(x.type) or np.float32, list(x.shape))
        sources = {i["name"]: (i["from"]["graph"], i["from"]["output"]) for i in graph.get("inputs", []) if i.get("from")}
        return Stage(graph["name"], session, inputs, [o.name for o in session.get_outputs()], sources)

    def _layout(self, cache_io: str | None) -> None:
        """Cache length C, per-layer cache shapes, and whether presents are new entries or the slid cache."""
        shapes = {}
        for stage in self.prefill + self.decode:
            for name, (_, shape) in stage.inputs.items():
                if (io.cache_name(name) or ("",))[0] == "past":
                    shapes[name] = shape
        if not shapes:
            raise InputError(f"{self.root}: the graphs have no past_key_<i>/past_value_<i> inputs")
        self.cache_shapes = shapes
        self.cache_len = next(iter(shapes.values()))[2]
        if cache_io is None:
            t = self.prefill[0].tokens
            present = next((o for o in self.prefill[0].outputs if io.past_of(o)), None)
            dims = self.prefill[0].session.get_outputs()[self.prefill[0].outputs.index(present)].shape if present else None
            cache_io = "sliding" if dims and dims[2] == self.cache_len and t != self.cache_len else "new"
        if cache_io not in layouts.LAYOUTS:
            raise InputError(f"{self.root}/manifest.json: cache_io '{cache_io}', expected one of {', '.join(layouts.LAYOUTS)}")
        self.cache_io = cache_io

    def _no_cache(self) -> None:
        stage = self.prefill[0]
        if any(io.cache_name(name) for name in stage.inputs):
            raise InputError(f"{self.root}: graph 'model' has cache inputs but no decode graph")
        fed = (io.INPUT_IDS, io.HIDDEN_STATES, io.ATTENTION_MASK, io.POSITION_IDS, io.POS_EMB)
        other = [name for name in stage.inputs if name not in fed and name not in stage.sources]
        if other:
            raise InputError(f"{self.root}: graph 'model' input '{other[0]}' is none the runtime feeds "
                             f"({', '.join(fed)}): its cache or extra inputs were not found by compile")
        self.cache_shapes, self.cache_len, self.cache_io = {}, 0, layouts.DEFAULT_LAYOUT

    def _host(self, manifest: dict, name: str, why: str) -> np.ndarray:
        table = host_table(self.root, manifest, name)
        if table is None:
            raise InputError(f"{self.root}/manifest.json: {why} but the manifest names no host table '{name}'")
        return table

    # ------------------------------------------------------------------ generation

    def reset(self) -> None:
        self.cache = {name: np.zeros(shape, np.float32) for name, shape in self.cache_shapes.items()}
        self.valid = np.zeros(self.cache_len, bool)
        self.filled = 0  # tokens whose K/V are in the cache (also the next position)
        self.stop_reason = None

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 observe: Callable[[np.ndarray], None] | None = None,
                 emit: Callable[[int], None] | None = None) -> list[int]:
        """Greedy tokens after `prompt_ids`; fewer when the cache fills (see `stop_reason`).
        `observe(logits [k, V])` sees the logits of every call's k real tokens, in order;
        `emit(token)` each new token as soon as it is chosen (streaming)."""
        prompt = [int(x) for x in prompt_ids]
        if not prompt:
            raise InputError("the prompt is empty")
        bad = next((x for x in prompt if not 0 <= x < self.vocab), None)
        if bad is not None:
            raise InputError(f"token id {bad} is outside the vocabulary (0..{self.vocab - 1})")
        emit = emit or (lambda token: None)
        self.reset()
        if max_new_tokens <= 0:
            return []
        t = self.prefill[0].tokens
        if self.full:
            return self._generate_full(prompt, max_new_tokens, t, observe, emit)
        for start in range(0, len(prompt), t):
            if not self.fits(t, len(prompt[start:start + t])):
                raise InputError(f"prompt of {len(prompt)} tokens does not fit the cache of {self.cache_len} "
                                 f"({self.cache_io} cache, {t} tokens per prefill call)")
            logits = self.step(self.prefill, prompt[start:start + t])
            if observe:
                observe(logits)
        out = [int(np.argmax(logits[-1]))]
        emit(out[-1])
        while len(out) < max_new_tokens:
            if not self.fits(1, 1):
                self.stop_reason = (f"cache full: {self.filled} tokens fill cache_len {self.cache_len}; "
                                    f"stopped after {len(out)} of {max_new_tokens} new tokens")
                log.warning("mtkc: %s", self.stop_reason)
                break
            logits = self.step(self.decode, out[-1:])
            if observe:
                observe(logits)
            out.append(int(np.argmax(logits[-1])))
            emit(out[-1])
        return out

    def _generate_full(self, prompt: list[int], max_new_tokens: int, t: int, observe, emit) -> list[int]:
        if len(prompt) > t:
            raise InputError(f"prompt of {len(prompt)} tokens does not fit the graph's {t} tokens "
                             "(compile with --kv-cache for longer sequences)")
        sequence, out = list(prompt), []
        while len(out) < max_new_tokens:
            if len(sequence) > t:
                self.stop_reason = (f"sequence full: the graph's seq_len {t} is reached; "
                                    f"stopped after {len(out)} of {max_new_tokens} new tokens")
                log.warning("mtkc: %s", self.stop_reason)
                break
            self.reset()
            logits = self.step(self.prefill, sequence)
            if observe:
                observe(logits if not out else logits[-1:])
            out.append(int(np.argmax(logits[-1])))
            emit(out[-1])
            sequence.append(out[-1])
        return out

    def fits(self, t: int, k: int) -> bool:
        """Whether a call of `k` tokens (padded to `t`) keeps every cached token."""
        return layouts.fits(self.cache_io, self.valid, self.filled, t, k)

    def step(self, stages: list[Stage], tokens: list[int]) -> np.ndarray:
        """Run `tokens` (at most T) through one prefill or decode pass; returns their logits [k, V]."""
        t, k = stages[0].tokens, len(tokens)
        ids = np.zeros((1, t), np.int64)
        ids[0, :k] = tokens
        rows = positions.of_call(self.filled, t, k)
        feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: rows[None]}
        results: dict[str, dict[str, np.ndarray]] = {}
        for stage in stages:
            feed = {}
            for name, (dtype, shape) in stage.inputs.items():
                if name in stage.sources:
                    graph, output = stage.sources[name]
                    if output not in results.get(graph, {}):
                        raise InputError(f"graph '{stage.name}': input '{name}' is wired from '{graph}' output "
                                         f"'{output}', which no earlier graph of this pass produced")
                    value = results[graph][output]
                elif name in self.cache:
                    value = self.cache[name]
                elif name == io.HIDDEN_STATES:
                    value = self.embedding[ids[0]][None]
                elif io.is_mask(name):
                    value = self._mask(shape, k, t, io.mask_window(name))
                elif name == io.POS_EMB:
                    value = positions.rope_rows(self.rope, rows)
                elif name in feeds:
                    value = feeds[name]
                else:
                    raise InputError(f"graph '{stage.name}': unknown input '{name}'")
                value = np.asarray(value, dtype=dtype)
                if shape and value.size != np.prod(shape):
                    raise InputError(f"graph '{stage.name}': input '{name}' has shape {shape}, the runtime feeds it "
                                     f"{list(value.shape)} (the contract's form; was it compiled with the mask and "
                                     "kv-cache passes?)")
                feed[name] = value.reshape(shape) if shape else value
            result = results[stage.name] = dict(zip(stage.outputs, stage.session.run(stage.outputs, feed)))
            self._update(result, k)
            logits = result.get(io.LOGITS)
        self.valid = layouts.advance(self.cache_io, self.valid, self.filled, t, k)
        self.filled += k
        return logits[0, :k]

    def _mask(self, shape: list[int], k: int, t: int, window: int | None = None) -> np.ndarray:
        if len(shape) == 2:  # the export's own int mask [1, C+T]: 1 = attend
            return np.concatenate([self.valid, np.arange(t) < k])[None]
        return mask.attention_mask(t, self.cache_len, self.mask_value, self.valid, np.arange(t) < k, window=window)

    def _update(self, result: dict[str, np.ndarray], k: int) -> None:
        for name, value in result.items():
            past = io.past_of(name)
            if past in self.cache:
                self.cache[past] = layouts.store(self.cache_io, self.cache[past], value, self.filled, k)


def _vocab(embedding: np.ndarray | None, stage: Stage) -> int:
    """Token ids the graphs accept: rows of the host embedding table, else the logits' last dim."""
    if embedding is not None:
        return int(embedding.shape[0])
    logits = next((o for o in stage.session.get_outputs() if o.name == "logits"), None)
    last = logits.shape[-1] if logits is not None and logits.shape else None
    return int(last) if isinstance(last, int) and last > 0 else 2**31 - 1


def host_table(root: Path, manifest: dict, name: str) -> np.ndarray | None:
    """A table of the manifest's `host` (memory-mapped, never unpickled), None when the manifest
    lists no `name`; its path confined to OUT."""
    entry = (manifest.get("host") or {}).get(name)
    if not entry:
        return None
    return load_table(confined(root, entry["path"], f"host table '{name}'"))


def host_tables(records, read_values) -> dict[str, np.ndarray | Callable[[], np.ndarray]]:
    """Tables the host needs after a pipeline run, as the passes returned them (`PassRecord.host`):
    `embedding` [V, H] (embedding pass, host-input mode) and `rope` [2, max_pos, D] (cos, sin;
    rope pass, pos_emb mode). A weight becomes a `WeightTable`, read only when written."""
    tables = {}
    for record in records:
        for name, table in record.host.items():
            tables[name] = table if isinstance(table, np.ndarray) else WeightTable(table, read_values)
    return tables


@dataclass(frozen=True)
class WeightTable:
    """A host table that is a model weight: read when called, streamed file-to-file when saved."""

    const: Any  # gs.Constant
    read_values: Callable

    def __call__(self) -> np.ndarray:
        return np.asarray(self.read_values(self.const), np.float32)


def _stream_npy(table: WeightTable, path: Path, writer: WeightWriter) -> bool:
    """Write a float32 external weight as .npy by copying its bytes (never held in memory; by
    `writer`'s copier, `WeightWriter.stream`); False when it is not such a weight. Same bytes as
    `np.save` of its values once `writer` is closed."""
    values = table.const._values
    if not isinstance(values, ExternalValues) or values.tensor.data_type != onnx.TensorProto.FLOAT:
        return False
    proto, location = values.tensor, external_info(values.tensor).get("location", "")
    what = f"{values.root / location}: tensor '{proto.name}'"
    head = BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": tuple(proto.dims)})
    try:
        _, offset, _ = external_fields(proto)
        with open_external(values.root, location) as src:
            writer.stream(path, head.getvalue(), src.fileno(), offset, external_size(proto), what)
    except (ExternalDataError, OSError) as exc:
        raise copy_error(exc, what) from None
    return True


def write_host_tables(out_dir: str | Path, tables: dict, writer: WeightWriter) -> dict[str, dict]:
    """Save each table (an array, or a callable returning one) as `host/<name>.npy` under `out_dir`
    (an external weight's bytes copied by `writer`'s copier, written once it is closed); returns the
    manifest's `host` entry."""
    entries = {}
    for name, table in sorted(tables.items()):
        path = Path(out_dir) / "host" / f"{name}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(table, WeightTable) and _stream_npy(table, path, writer):
            shape = list(table.const.shape)
            entries[name] = {"path": f"host/{name}.npy", "dtype": "float32", "shape": shape}
            continue
        table = table() if callable(table) else table
        np.save(path, table)
        entries[name] = {"path": f"host/{name}.npy", "dtype": str(table.dtype), "shape": list(table.shape)}
    return entries


def generate(out_dir: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation through the compiled graphs in `out_dir` (see `Generator`)."""
    return Generator(out_dir).generate(prompt_ids, max_new_tokens)
