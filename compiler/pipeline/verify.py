"""Check a compiled folder against the original model, numerically, in onnxruntime.

Two independent comparisons; verify is ok only when both compared something and all agreed:

* the oracle (`mtkc.pipeline.oracle`): the original run as its exporter meant
  it (its own inputs and mask form, its cache growing from empty, no padding) against the
  compiled graphs through the reference runtime, on seeded prompts shorter and longer than T:
  logits at every real position and the greedy tokens;
* per graph: for every graph in the manifest, two pipelines run on the same seeded inputs: the partitions
wired by the manifest (what the device will run, NPU pieces included) and the whole rewritten
graph (`graphs[].path`). Each is compared with the original model per output: max abs error,
max rel error, cosine similarity. The original is `manifest.model.path` (absolute) or `--model`.
Graphs wired together by the manifest (an input with `"from": {"graph", "output"}`: layer
chunks) run as one chain per sample, each chunk fed its predecessor's output (`chains`).

The compiled graph's inputs may differ from the original's (DESIGN contract). Feeds are built
for the original first (token ids inside the vocabulary, all-ones mask, positions C..C+T-1,
random past K/V; symbolic dims unified with the compiled shapes), then mapped onto the
compiled inputs:

    original                       compiled
    input_ids int64 [1,T]       -> input_ids (cast) | hidden_states = host embedding[ids]
    attention_mask [1,C+T] ones -> attention_mask additive float [1,1,T,C+T] (causal, 0 / mask value)
    position_ids (or implied)   -> position_ids (cast) | pos_emb = host rope[:, positions]
    past_key_values.i.key       -> past_key_i  (and value; hf `input.cache.layers.i.keys` too)
    (no cache)                  -> past_key_i zeros, masked out (cache inserted by mtkc)
Outputs: same name, or `present.i.key` <-> `present_key_i` (compiled may hold only the new T rows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.backend.manifest import sha256
from mtkc.contract import exporters, io
from mtkc.contract import mask as contract_mask
from mtkc.contract.positions import rope_rows
from mtkc.display import Progress, escape
from mtkc.errors import InputError
from mtkc.ir.compare import compare
from mtkc.ir.model import read_proto
from mtkc.ir.outdir import read_manifest
from mtkc.pipeline.oracle import (LAST, NEW_TOKENS, Generation, Original, OriginalRun, compare_generation,
                                  picks_positions, prompts)
from mtkc.runtime.generate import Generator, host_table
from mtkc.runtime.graphs import guarded, load_session, run_partitions, run_session
from mtkc.runtime.sessions import Sessions

DYNAMIC_SEQ = 8  # tokens per sample when the compiled graph leaves the sequence length open
TOLERANCE = 1e-3  # default atol and rtol
TOLERANCE_FP16 = 1e-2  # for an fp16 export: ~10 fp16 steps (2^-10) of the largest logit


@dataclass
class Check:
    graph: str
    pipeline: str  # "partitions" | "graph"
    output: str
    original: str
    max_abs: float
    max_rel: float
    cosine: float
    ok: bool


@dataclass
class Result:
    checks: list[Check]
    skipped: list[str]
    samples: int
    atol: float
    rtol: float
    min_cosine: float

    generations: list[Generation] = field(default_factory=list)  # the oracle's, one per prompt
    notes: list[str] = field(default_factory=list)  # how the original computes differently by design

    @property
    def compared(self) -> int:
        return len(self.checks) + len(self.generations)

    @property
    def ok(self) -> bool:
        return self.compared > 0 and all(c.ok for c in self.checks) and all(g.ok for g in self.generations)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def failure(self) -> str:
        """One line naming the first failure (or that nothing was compared)."""
        if not self.compared:
            return "verify: nothing was compared (" + ("; ".join(self.skipped) or "no graph with a matching output") + ")"
        bad = next((g for g in self.generations if not g.ok), None)
        if bad is not None:
            what = (f"tokens {bad.actual} != the original's {bad.expected}" if bad.actual != bad.expected
                    else f"logits at step {bad.worst_step}: max abs {bad.max_abs:.3g}, cosine {bad.cosine:.6f}")
            why = f" ({self.notes[0]})" if self.notes and bad.actual != bad.expected else ""
            return f"verify: generation from a {bad.prompt_len}-token prompt differs from the original export: {what}{why}"
        first = self.failures[0]
        return (f"verify: graph '{first.graph}' output '{first.output}' ({first.pipeline}) does not match the original "
                f"'{first.original}': max abs {first.max_abs:.3g}, cosine {first.cosine:.6f} "
                f"(atol {self.atol:g}, rtol {self.rtol:g}, min cosine {self.min_cosine:g})")

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "compared": self.compared,
            "generations": [g.to_json() for g in self.generations],
            "samples": self.samples,
            "atol": self.atol,
            "rtol": self.rtol,
            "min_cosine": self.min_cosine,
            "checks": [asdict(c) for c in self.checks],
            "skipped": self.skipped,
            "notes": self.notes,
        }


def load_manifest(out: Path) -> dict:
    return read_manifest(out)  # shape checked, every path confined to OUT


def original_path(manifest: dict, out: Path, override: str | Path | None = None) -> Path:
    """The source model: `--model`, else the manifest's `model` (absolute, or relative to OUT)."""
    recorded = manifest.get("model")
    if isinstance(recorded, dict):
        recorded = recorded.get("path")
    path = Path(override) if override else (Path(out) / recorded if recorded else None)
    if path is None:
        raise InputError(f"{out}/manifest.json records no source model; pass --model PATH")
    if not path.is_file():
        raise InputError(f"{path}: source model not found; pass --model PATH")
    return path


@dataclass
class Host:
    """Host-side tables a runtime feeds from (manifest `host`: `embedding` [V,H], `rope` [2,P,D])."""

    embedding: np.ndarray | None = None
    rope: np.ndarray | None = None
    mask_value: float = contract_mask.DEFAULT_VALUE

    @classmethod
    def from_manifest(cls, manifest: dict, out: Path) -> Host:
        return cls(host_table(out, manifest, "embedding"), host_table(out, manifest, "rope"),
                   contract_mask.value_of(manifest.get("options")))


def build_feeds(original_inputs, compiled_inputs: list[dict], vocab: int, seed: int,
                host: Host | None = None, aliases: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Seeded feeds for the original model and the equivalent feeds for the compiled graph.

    When the compiled graph has a KV cache the original lacks (cache inserted by mtkc), the
    cache is zeros and fully masked: both then compute the same T tokens from position 0.
    """
    host = host or Host()
    by_name = {i["name"]: i for i in compiled_inputs}
    kv_of = {a.name: exporters.contract_name(a.name) for a in original_inputs
             if exporters.contract_name(a.name) in by_name}  # original cache input name -> compiled past_*_i
    kv_of.update((o, c) for o, c in (aliases or {}).items() if c in by_name)  # found by structure
    dims: dict[str, int] = {}  # symbolic dims of the original, unified with the compiled shapes
    for arg in original_inputs:
        twin = by_name.get(kv_of.get(arg.name, arg.name))
        if twin and twin["shape"] and len(twin["shape"]) == len(arg.shape):
            for d, size in zip(arg.shape, twin["shape"]):
                if isinstance(d, str) and isinstance(size, int):
                    dims.setdefault(d, size)
    seq = _dim(by_name, ("input_ids", "hidden_states", "position_ids"), 1, default=dims.get("sequence_length", DYNAMIC_SEQ))
    mask = by_name.get("attention_mask", {}).get("shape") or []
    if len(mask) == 4 and all(isinstance(d, int) for d in mask):
        cache = mask[3] - mask[2]
    else:
        cache = next((i["shape"][2] for i in compiled_inputs if _is_past(i["name"])),
                     dims.get("past_sequence_length", 0))
    original_cached = any(a.name in kv_of or "past_sequence_length" in a.shape for a in original_inputs) or not any(
        _is_past(n) for n in by_name)
    past = cache if original_cached else 0  # tokens before the new ones, as the original sees them
    dims = {"batch_size": 1, "batch": 1, "sequence_length": seq, "past_sequence_length": past,
            "total_sequence_length": past + seq, **dims}
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (1, seq))
    positions = np.arange(past, past + seq)
    original: dict[str, np.ndarray] = {}
    for arg in original_inputs:
        dtype = _np_dtype(arg.type)
        name = arg.name
        kv = kv_of.get(name)
        if name == "input_ids":
            original[name] = ids.astype(dtype)
        elif name == "attention_mask":
            original[name] = np.ones((1, past + seq), dtype)
        elif name == "position_ids":
            original[name] = positions.astype(dtype)[None]
        elif kv is not None:
            original[name] = rng.standard_normal(by_name[kv]["shape"]).astype(dtype)
        elif picks_positions(name, arg.shape) and np.issubdtype(dtype, np.integer):
            original[name] = np.array(LAST, dtype)  # its logits: the last position's row
        else:
            shape = [_resolve(d, k, dims, by_name.get(name)) for k, d in enumerate(arg.shape)]
            original[name] = (rng.integers(0, vocab, shape) if np.issubdtype(dtype, np.integer)
                              else rng.standard_normal(shape)).astype(dtype)
    source_of = {kv: name for name, kv in kv_of.items() if name in original}
    compiled: dict[str, np.ndarray] = {}
    for spec in compiled_inputs:
        name, dtype, shape = spec["name"], _manifest_dtype(spec["dtype"]), spec["shape"]
        source = source_of.get(name)
        if io.is_mask(name) and len(shape) == 4:
            compiled[name] = contract_mask.additive(shape[2], shape[3], host.mask_value, np.arange(shape[3]) >= cache - past,
                                                    dtype, window=io.mask_window(name))[None, None]
        elif name in original and _fits(original[name].shape, shape):
            compiled[name] = original[name].astype(dtype)
        elif name == "position_ids":
            compiled[name] = positions.astype(dtype).reshape(shape)
        elif source is not None:
            compiled[name] = original[source].astype(dtype)
        elif _is_past(name) and not original_cached:
            compiled[name] = np.zeros(shape, dtype)
        elif name == "hidden_states" and host.embedding is not None:
            compiled[name] = np.asarray(host.embedding[ids[0]], dtype)[None].reshape(shape)
        elif name == "pos_emb" and host.rope is not None:
            compiled[name] = rope_rows(host.rope, positions).astype(dtype).reshape(shape)
        else:
            raise InputError(f"verify: no rule builds compiled input '{name}' {shape} from the original model's inputs")
    return original, compiled


def match_output(name: str, original_names: list[str]) -> str | None:
    """The original output a compiled output is compared with (same name, or its cache spelling)."""
    if name in original_names:
        return name
    return next((o for o in original_names if exporters.contract_name(o) == name), None)


def chains(graphs: list[dict]) -> list[list[dict]]:
    """Manifest graphs grouped by their wiring (inputs with `from`), each group in manifest order:
    `[model]`, or `[prefill], [decode]`, or `[prefill_0, prefill_1, ...], [decode_0, ...]`."""
    order = {g["name"]: k for k, g in enumerate(graphs)}
    root: dict[str, str] = {}
    for g in graphs:
        sources = [i["from"]["graph"] for i in g["inputs"] if i.get("from")]
        for s in sources:
            if s not in root:
                raise InputError(f"manifest: graph '{g['name']}' input is wired from '{s}', not an earlier graph")
        joined = {root[s] for s in sources}
        head = min(joined, key=order.get) if joined else g["name"]
        root.update({n: head for n, r in root.items() if r in joined})
        root[g["name"]] = head
    groups: dict[str, list[dict]] = {}
    for g in graphs:
        groups.setdefault(root[g["name"]], []).append(g)
    return list(groups.values())


def verify(out: str | Path, samples: int = 3, atol: float | None = None, rtol: float | None = None, min_cosine: float = 0.999,
           model: str | Path | None = None, new_tokens: int = NEW_TOKENS) -> Result:
    """The oracle (`new_tokens` greedy tokens per prompt, 0: off), then every
    manifest graph (partitions wired, and whole) compared with the original model.

    Graphs wired together (layer chunks) run as one chain per sample: the original model runs
    once, chunk k is fed chunk k-1's output named by its input's `from`, and every chunk's
    outputs are compared with the original's (logits from the last chunk, present_* from each).
    Two phases, so the original's and the compiled weights are never in memory together: the
    original runs everything it is asked (generations, per-graph expected outputs) and is released;
    then the compiled graphs run (whole graphs on the runtime's sessions, then partitions).
    """
    out = Path(out)
    manifest = load_manifest(out)
    source = original_path(manifest, out, model)
    recorded = (manifest.get("model") or {}).get("sha256") if isinstance(manifest.get("model"), dict) else None
    if recorded and sha256(source) != recorded:
        raise InputError(f"{source}: not the model compiled into {out} (sha256 differs from the manifest's "
                         f"{recorded[:12]}…); pass the compiled model with --model")
    try:
        reference = load_session(source)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{source}: the original model does not load in onnxruntime ({type(exc).__name__})") from None
    proto = read_proto(Path(source))  # structure only: weights stay in the file
    aliases = _export_names(proto)  # cache I/O and logits the exporter named its own way
    notes = _notes(proto)
    half = any(o.type == "tensor(float16)" for o in reference.get_outputs())
    if half and (atol is None or rtol is None):
        notes.append(f"the original computes in fp16: default atol/rtol {TOLERANCE_FP16:g}")
    atol, rtol = (v if v is not None else TOLERANCE_FP16 if half else TOLERANCE for v in (atol, rtol))
    del proto
    skipped: list[str] = []
    host = Host.from_manifest(manifest, out)
    generator = _runtime(out, skipped if new_tokens > 0 else [])  # sessions made, weights not yet touched
    chained = chains(manifest.get("graphs", []))
    with Progress("verify: original export", total=len(chained) * samples, unit="run") as progress:
        runs = original_runs(generator, manifest, reference, new_tokens, skipped, progress)
        original_outputs = [o.name for o in reference.get_outputs()]
        original_outputs += [aliases[o] for o in original_outputs if o in aliases]
        planned = list(_expected(manifest, reference, samples, host, aliases, source, progress))
    del reference  # phase 2: the compiled graphs only
    progress = Progress("verify: compiled graphs", total=len(runs) + 2 * len(planned), unit="run")
    generations = []
    for run in runs:
        generations.append(guarded(lambda: compare_generation(generator, run, compare, atol, rtol, min_cosine),
                                   "generation"))
        progress.advance()
    worst: dict[tuple, Check] = {}
    for pipeline in ("graph", "partitions"):  # whole graphs on the runtime's sessions, then (those released) partitions
        wholes = {s.name: s.session for s in generator.prefill + generator.decode} if generator else {}
        sessions = generator.sessions if generator else Sessions(out, optimize=False)
        generator = None
        for chain, feeds, expected in planned:
            wired = {(i["from"]["graph"], i["from"]["output"]) for g in chain for i in g["inputs"] if i.get("from")}
            made: dict[tuple[str, str], np.ndarray] = {}
            for g in chain:
                gfeeds = {i["name"]: made[i["from"]["graph"], i["from"]["output"]] if i.get("from") else feeds[i["name"]]
                          for i in g["inputs"]}
                if pipeline == "partitions":
                    outputs = run_partitions(out, g, gfeeds, sessions)
                else:
                    if g["name"] not in wholes:
                        wholes[g["name"]] = guarded(lambda: sessions.get(out / g["path"]), f"graph {g['path']}")
                    outputs = guarded(lambda: run_session(wholes[g["name"]], gfeeds), f"graph {g['path']}")
                made.update(((g["name"], name), value) for name, value in outputs.items())
                for name, value in outputs.items():
                    if (g["name"], name) not in wired:
                        _record(worst, skipped, g["name"], pipeline, name, value, expected, original_outputs,
                                atol, rtol, min_cosine)
            progress.advance()
    progress.close()
    checks = sorted(worst.values(), key=lambda c: c.pipeline != "partitions")  # stable: manifest order in each
    return Result(checks, skipped, samples, atol, rtol, min_cosine, generations, notes)


def _expected(manifest: dict, reference, samples: int, host: Host, aliases: dict[str, str], source: Path,
              progress: Progress):
    """(chain, compiled feeds, the original's outputs) per chain and seeded sample."""
    for chain in chains(manifest.get("graphs", [])):
        host_inputs: dict[str, dict] = {}  # the chain's inputs that the host builds, first spec per name
        for g in chain:
            for i in g["inputs"]:
                if not i.get("from"):
                    host_inputs.setdefault(i["name"], i)
        vocab = _vocab(next((g for g in chain if any(o["name"] == io.LOGITS for o in g["outputs"])), chain[-1]), reference)
        for sample in range(samples):
            orig_feeds, feeds = build_feeds(reference.get_inputs(), list(host_inputs.values()), vocab, sample, host,
                                            aliases)
            try:
                expected = run_session(reference, orig_feeds)
            except Exception as exc:  # the export itself does not run: bad input, not a mismatch
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                raise InputError(f"{source}: the original model does not run in onnxruntime: {first}") from None
            expected.update({aliases[k]: v for k, v in list(expected.items()) if k in aliases})
            progress.advance()
            yield chain, feeds, expected


def _runtime(out: Path, skipped: list[str]):
    """The reference runtime over OUT's graphs, or None (why, in `skipped`) when they are outside its contract."""
    try:
        return guarded(lambda: Generator(out), "the reference runtime")
    except InputError as exc:  # e.g. compiled without the kv-cache pass: exporter cache names left
        skipped.append(f"oracle: the reference runtime cannot run these graphs: {exc}")
        return None


def original_runs(generator, manifest: dict, reference, new_tokens: int, skipped: list[str],
                  progress: Progress | None = None) -> list[OriginalRun]:
    """The original's greedy runs on the oracle's prompts (see `mtkc.pipeline.oracle`); why it
    could not run goes to `skipped`."""
    if new_tokens <= 0 or generator is None:
        return []
    original = Original.of(reference, generator.cache_shapes)
    if isinstance(original, str):
        skipped.append(f"oracle: the original export cannot be run as exported: {original}")
        return []
    vocab = _vocab(next(g for g in manifest["graphs"] if any(o["name"] == io.LOGITS for o in g["outputs"])), reference)
    todo, runs = prompts(generator.prefill[0].tokens, generator.cache_len, vocab, new_tokens), []
    if progress is not None:
        progress.total += len(todo)
    for prompt in todo:
        runs.append(guarded(lambda: original.run(prompt, new_tokens), "the original export"))
        if progress is not None:
            progress.advance()
    return runs


def _record(worst: dict, skipped: list, graph: str, pipeline: str, name: str, value: np.ndarray, expected: dict,
            original_outputs: list[str], atol: float, rtol: float, min_cosine: float) -> None:
    """Compare one compiled output with its original; keep the worst figures per (graph, pipeline, output)."""
    source = match_output(name, original_outputs)
    if source is None:
        note = f"{graph}/{name}: no matching original output"
        if note not in skipped:
            skipped.append(note)
        return
    want = expected[source]
    if name == io.LOGITS and value.ndim == 3 and want.ndim == 2:
        value = value[:, LAST]  # the original kept one position (logits_to_keep = LAST)
    if value.shape != want.shape and value.ndim == want.ndim == 4 and io.cache_name(name):
        want = want[:, :, -value.shape[2]:, :]  # new-entry-only present
    if value.shape != want.shape:
        check = Check(graph, pipeline, name, source, float("inf"), float("inf"), 0.0, False)
    else:
        max_abs, max_rel, cosine, close = compare(value, want, atol, rtol)
        check = Check(graph, pipeline, name, source, max_abs, max_rel, cosine, close and cosine >= min_cosine)
    key = (graph, pipeline, name)
    w = worst.get(key)
    worst[key] = check if w is None else Check(w.graph, w.pipeline, w.output, w.original, max(w.max_abs, check.max_abs),
                                               max(w.max_rel, check.max_rel), min(w.cosine, check.cosine), w.ok and check.ok)


def format_text(result: Result, every_output: bool = False) -> str:
    """A row per graph and pipeline (its outputs' worst figures) and one per mismatching output;
    `every_output` (-v): a row per output. The generations, skips, notes and the verdict follow."""
    rows = [("graph", "pipeline", "output", "max abs", "max rel", "cosine", "status")]
    groups: dict[tuple[str, str], list[Check]] = {}
    for c in result.checks:
        groups.setdefault((c.graph, c.pipeline), []).append(c)
    for (graph, pipeline), checks in groups.items():
        if not every_output and len(checks) > 1:
            worst = Check(graph, pipeline, f"{len(checks)} outputs", "", max(c.max_abs for c in checks),
                          max(c.max_rel for c in checks), min(c.cosine for c in checks), all(c.ok for c in checks))
            checks = [worst, *(c for c in checks if not c.ok)]
        for c in checks:
            rows.append((escape(c.graph), c.pipeline, escape(c.output), f"{c.max_abs:.3g}", f"{c.max_rel:.3g}",
                         f"{c.cosine:.6f}", "ok" if c.ok else "MISMATCH"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"skipped: {escape(s)}" for s in result.skipped]
    lines += [f"note: {n}" for n in result.notes]
    for g in result.generations:
        lines.append(f"generate  prompt {g.prompt_len} tokens: {g.steps} logits rows, max abs {g.max_abs:.3g}, "
                     f"min cosine {g.cosine:.6f}; tokens {'equal' if g.expected == g.actual else 'DIFFER'} "
                     f"({len(g.expected)} new) {'ok' if g.ok else 'MISMATCH'}")
    bad = len(result.failures) + sum(not g.ok for g in result.generations)
    verdict = ("ok" if result.ok else "NOTHING COMPARED" if not result.compared
               else f"MISMATCH in {bad} comparison(s)")
    lines.append(f"{verdict} ({result.samples} sample(s), atol {result.atol:g}, rtol {result.rtol:g}, "
                 f"min cosine {result.min_cosine:g})")
    return "\n".join(lines)


def _export_names(proto) -> dict[str, str]:
    """{export name: contract name} of the export's cache I/O and logits, found by structure."""
    graph = gs.import_onnx(proto)
    return decoder_map(graph).contract_names(graph)


_ROUNDED = {2: "fp16", 3: "bf16", 4: "int8"}  # MatMulNBits accuracy_level -> activations onnxruntime may use


def _notes(proto) -> list[str]:
    """Where the original, run as exported, computes differently from the compiled graphs by design."""
    levels = {a.i for n in proto.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level" and a.i in _ROUNDED}
    if not levels:
        return []
    level = max(levels)
    return [f"the original's MatMulNBits have accuracy_level {level}: onnxruntime may round their activations to "
            f"{_ROUNDED[level]}, the compiled graphs keep them in float (same int4 weights), so near-tied tokens can "
            "differ; an exact reference is the export with accuracy_level=1 (builder --extra_options accuracy_level=1)"]


def _vocab(graph: dict, reference) -> int:
    logits = next((o for o in graph["outputs"] if o["name"] == "logits"), None)
    if logits and logits["shape"] and isinstance(logits["shape"][-1], int):
        return logits["shape"][-1]
    ref = next((o for o in reference.get_outputs() if o.name == "logits"), None)
    return ref.shape[-1] if ref is not None and isinstance(ref.shape[-1], int) else 100


def _dim(by_name: dict, names: tuple[str, ...], axis: int, default: int) -> int:
    for name in names:
        shape = by_name.get(name, {}).get("shape")
        if shape and len(shape) > axis and isinstance(shape[axis], int):
            return shape[axis]
    return default


def _fits(actual: tuple, declared: list | None) -> bool:
    """Whether a concrete shape fits a manifest shape (symbolic dims fit any size)."""
    return declared is None or (len(actual) == len(declared) and
                                all(not isinstance(d, int) or d == a for a, d in zip(actual, declared)))


def _resolve(dim, axis: int, dims: dict, compiled: dict | None) -> int:
    if isinstance(dim, int) and dim >= 0:
        return dim
    if isinstance(dim, str) and dim in dims:
        return dims[dim]
    if compiled and compiled.get("shape") and len(compiled["shape"]) > axis and isinstance(compiled["shape"][axis], int):
        return compiled["shape"][axis]
    return 1


def _is_past(name: str) -> bool:
    return (io.cache_name(name) or ("",))[0] == "past"


def _np_dtype(ort_type: str) -> np.dtype:
    dtype = io.ort_dtype(ort_type)
    if dtype is None:
        raise InputError(f"verify: unsupported input type {ort_type}")
    return dtype


def _manifest_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        raise InputError(f"manifest: unknown dtype '{name}'") from None
