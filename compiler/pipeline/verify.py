"""Check a compiled folder against the original model, numerically, in onnxruntime.

For every graph in the manifest, two pipelines run on the same seeded inputs: the partitions
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

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from mtkc.errors import InputError, MismatchError
from mtkc.ir.execute import session

DYNAMIC_SEQ = 8  # tokens per sample when the compiled graph leaves the sequence length open
MASK_MIN = -1.0e4  # any large finite negative value: softmax weight exp(-1e4) == 0 in fp32/fp16
KV_INPUT = re.compile(r"^past_(key|value)_(\d+)$")
KV_OUTPUT = re.compile(r"^present_(key|value)_(\d+)$")
ORIGINAL_KV = (  # spellings of layer i's cache tensors: optimum/legacy, mtkc, transformers' exporter
    "{io}.{i}.{kind}",
    "{io}_key_values.{i}.{kind}",
    "{io}_{kind}_{i}",
    "{hf}.cache.layers.{i}.{kind}s",
)


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

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "samples": self.samples,
            "atol": self.atol,
            "rtol": self.rtol,
            "min_cosine": self.min_cosine,
            "checks": [asdict(c) for c in self.checks],
            "skipped": self.skipped,
        }


def load_manifest(out: Path) -> dict:
    path = Path(out) / "manifest.json"
    if not path.is_file():
        raise InputError(f"{path}: no manifest (is {out} an mtkc compile output?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


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


def load_session(path: Path):
    """An ORT CPU session for an ONNX file, external data resolved beside it."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise InputError(f"{path}: cannot load ({type(exc).__name__})") from None
    return session(proto, path.parent)


def run_partitions(out: Path, graph: dict, feeds: dict[str, np.ndarray], sessions: dict | None = None) -> dict[str, np.ndarray]:
    """Run the partitions in manifest order, each fed by name from the graph inputs and earlier partitions."""
    sessions = {} if sessions is None else sessions
    env = dict(feeds)
    for part in graph["partitions"]:
        missing = [i["name"] for i in part["inputs"] if i["name"] not in env]
        if missing:
            raise InputError(f"manifest: partition {graph['name']}/{part['id']} input '{missing[0]}' is made by no earlier partition")
        path = Path(out) / part["path"]
        if path not in sessions:
            sessions[path] = _guarded(lambda: load_session(path), f"partition {graph['name']}/{part['id']}")
        names = [o["name"] for o in part["outputs"]]
        feeds_ = {i["name"]: env[i["name"]] for i in part["inputs"]}
        env.update(zip(names, _guarded(lambda: sessions[path].run(names, feeds_), f"partition {graph['name']}/{part['id']}")))
    return {o["name"]: env[o["name"]] for o in graph["outputs"]}


def run_session(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _guarded(call, what: str):
    """Run one onnxruntime call; a runtime failure is a verification failure naming `what`."""
    try:
        return call()
    except (MismatchError, InputError):
        raise
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MismatchError(f"verify: {what} does not run in onnxruntime: {first[:300]}") from None


def compare(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[float, float, float, bool]:
    """(max abs, max rel, cosine, close). Rel error is taken where |expected| > atol (no 0/0 noise).

    close: every |actual - expected| <= atol + rtol * max|expected| — rtol is relative to the
    output's scale, not to each element: reordered fp32 arithmetic (which every rewrite and
    onnxruntime's own optimizer do) moves a 24-layer model's logits by ~1e-4 of their scale, and
    an elementwise rtol would call that a mismatch wherever a value happens to be near zero.
    """
    a = np.asarray(actual, np.float64).ravel()
    b = np.asarray(expected, np.float64).ravel()
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    big = np.abs(b) > atol
    max_rel = float((diff[big] / np.abs(b[big])).max()) if big.any() else 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cosine = 1.0 if na == 0 and nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0
    scale = float(np.abs(b).max()) if b.size else 0.0
    close = max_abs <= atol + rtol * scale and bool(np.isfinite(a).all())
    return max_abs, max_rel, cosine, close


@dataclass
class Host:
    """Host-side tables a runtime feeds from (manifest `host`: `embedding` [V,H], `rope` [2,P,D])."""

    embedding: np.ndarray | None = None
    rope: np.ndarray | None = None
    mask_value: float = MASK_MIN

    @classmethod
    def from_manifest(cls, manifest: dict, out: Path) -> "Host":
        tables = {}
        for name, entry in (manifest.get("host") or {}).items():
            path = Path(out) / entry["path"]
            if not path.is_file():
                raise InputError(f"{path}: host table '{name}' listed in the manifest is missing")
            tables[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        mask_value = (manifest.get("options") or {}).get("mask_value")
        return cls(tables.get("embedding"), tables.get("rope"), float(mask_value) if mask_value is not None else MASK_MIN)


def build_feeds(original_inputs, compiled_inputs: list[dict], vocab: int, seed: int,
                host: Host | None = None, aliases: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Seeded feeds for the original model and the equivalent feeds for the compiled graph.

    When the compiled graph has a KV cache the original lacks (cache inserted by mtkc), the
    cache is zeros and fully masked: both then compute the same T tokens from position 0.
    """
    host = host or Host()
    by_name = {i["name"]: i for i in compiled_inputs}
    kv_of = _kv_names(by_name, "past", KV_INPUT)  # original cache input name -> compiled past_*_i
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
        cache = next((i["shape"][2] for i in compiled_inputs if KV_INPUT.match(i["name"])),
                     dims.get("past_sequence_length", 0))
    original_cached = any(a.name in kv_of or "past_sequence_length" in a.shape for a in original_inputs) or not any(
        KV_INPUT.match(n) for n in by_name)
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
        else:
            shape = [_resolve(d, k, dims, by_name.get(name)) for k, d in enumerate(arg.shape)]
            original[name] = (rng.integers(0, vocab, shape) if np.issubdtype(dtype, np.integer)
                              else rng.standard_normal(shape)).astype(dtype)
    source_of = {kv: name for name, kv in kv_of.items() if name in original}
    compiled: dict[str, np.ndarray] = {}
    for spec in compiled_inputs:
        name, dtype, shape = spec["name"], _manifest_dtype(spec["dtype"]), spec["shape"]
        source = source_of.get(name)
        if name == "attention_mask" and len(shape) == 4:
            compiled[name] = causal_mask(shape[2], shape[3], dtype, host.mask_value, hidden=cache - past)
        elif name in original and _fits(original[name].shape, shape):
            compiled[name] = original[name].astype(dtype)
        elif name == "position_ids":
            compiled[name] = positions.astype(dtype).reshape(shape)
        elif source is not None:
            compiled[name] = original[source].astype(dtype)
        elif KV_INPUT.match(name) and not original_cached:
            compiled[name] = np.zeros(shape, dtype)
        elif name == "hidden_states" and host.embedding is not None:
            compiled[name] = np.asarray(host.embedding[ids[0]], dtype)[None].reshape(shape)
        elif name == "pos_emb" and host.rope is not None:
            compiled[name] = np.asarray(host.rope[:, positions], dtype)[None].reshape(shape)
        else:
            raise InputError(f"verify: no rule builds compiled input '{name}' {shape} from the original model's inputs")
    return original, compiled


def causal_mask(seq: int, total: int, dtype, value: float = MASK_MIN, hidden: int = 0) -> np.ndarray:
    """Additive [1,1,T,C+T] mask: row i sees cache slots >= `hidden` and new positions <= i."""
    cache = total - seq
    cols = np.arange(total)[None, :]
    allowed = (cols <= cache + np.arange(seq)[:, None]) & (cols >= hidden)
    return np.where(allowed, 0.0, value).astype(dtype)[None, None]


def match_output(name: str, original_names: list[str]) -> str | None:
    """The original output a compiled output is compared with (same name, or its cache spelling)."""
    if name in original_names:
        return name
    return next((o for o, c in _kv_names([name], "present", KV_OUTPUT).items() if o in original_names), None)


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


def verify(out: str | Path, samples: int = 3, atol: float = 1e-3, rtol: float = 1e-3, min_cosine: float = 0.999,
           model: str | Path | None = None) -> Result:
    """Compare every manifest graph (partitions wired, and whole) with the original model.

    Graphs wired together (layer chunks) run as one chain per sample: the original model runs
    once, chunk k is fed chunk k-1's output named by its input's `from`, and every chunk's
    outputs are compared with the original's (logits from the last chunk, present_* from each).
    """
    out = Path(out)
    manifest = load_manifest(out)
    source = original_path(manifest, out, model)
    try:
        reference = load_session(source)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{source}: the original model does not load in onnxruntime ({type(exc).__name__})") from None
    aliases = _export_names(source)  # cache I/O and logits the exporter named its own way
    original_outputs = [o.name for o in reference.get_outputs()]
    original_outputs += [aliases[o] for o in original_outputs if o in aliases]
    worst: dict[tuple, Check] = {}
    skipped: list[str] = []
    sessions: dict = {}
    host = Host.from_manifest(manifest, out)
    for chain in chains(manifest.get("graphs", [])):
        wholes = {g["name"]: _guarded(lambda: load_session(out / g["path"]), f"graph {g['path']}") for g in chain}
        wired = {(i["from"]["graph"], i["from"]["output"]) for g in chain for i in g["inputs"] if i.get("from")}
        host_inputs: dict[str, dict] = {}  # the chain's inputs that the host builds, first spec per name
        for g in chain:
            for i in g["inputs"]:
                if not i.get("from"):
                    host_inputs.setdefault(i["name"], i)
        vocab = _vocab(next((g for g in chain if any(o["name"] == "logits" for o in g["outputs"])), chain[-1]), reference)
        for sample in range(samples):
            orig_feeds, feeds = build_feeds(reference.get_inputs(), list(host_inputs.values()), vocab, sample, host,
                                            aliases)
            try:
                expected = run_session(reference, orig_feeds)
            except Exception as exc:  # the export itself does not run: bad input, not a mismatch
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                raise InputError(f"{source}: the original model does not run in onnxruntime: {first}") from None
            expected.update({aliases[k]: v for k, v in list(expected.items()) if k in aliases})
            for pipeline in ("partitions", "graph"):
                made: dict[tuple[str, str], np.ndarray] = {}
                for g in chain:
                    gfeeds = {i["name"]: made[i["from"]["graph"], i["from"]["output"]] if i.get("from") else feeds[i["name"]]
                              for i in g["inputs"]}
                    if pipeline == "partitions":
                        outputs = run_partitions(out, g, gfeeds, sessions)
                    else:
                        outputs = _guarded(lambda: run_session(wholes[g["name"]], gfeeds), f"graph {g['path']}")
                    made.update(((g["name"], name), value) for name, value in outputs.items())
                    for name, value in outputs.items():
                        if (g["name"], name) not in wired:
                            _record(worst, skipped, g["name"], pipeline, name, value, expected, original_outputs,
                                    atol, rtol, min_cosine)
    return Result(list(worst.values()), skipped, samples, atol, rtol, min_cosine)


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
    if value.shape != want.shape and value.ndim == want.ndim == 4 and KV_OUTPUT.match(name):
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


def format_text(result: Result) -> str:
    rows = [("graph", "pipeline", "output", "max abs", "max rel", "cosine", "status")]
    for c in result.checks:
        rows.append((c.graph, c.pipeline, c.output, f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", f"{c.cosine:.6f}",
                     "ok" if c.ok else "MISMATCH"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"skipped: {s}" for s in result.skipped]
    verdict = "ok" if result.ok else f"MISMATCH in {len(result.failures)} output(s)"
    lines.append(f"{verdict} ({result.samples} sample(s), atol {result.atol:g}, rtol {result.rtol:g}, "
                 f"min cosine {result.min_cosine:g})")
    return "\n".join(lines)


def _export_names(source: Path) -> dict[str, str]:
    """{export name: contract name} of the export's cache I/O and logits, found by structure."""
    import onnx_graphsurgeon as gs

    from mtkc.passes.kv_cache import export_names

    try:
        return export_names(gs.import_onnx(onnx.load(str(source), load_external_data=False)))
    except InputError:
        return {}


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


def _kv_names(compiled_names, io: str, regex: re.Pattern) -> dict[str, str]:
    """Every exporter spelling of each compiled cache tensor (`past_key_3`) -> that compiled name."""
    spellings = {}
    for name in compiled_names:
        m = regex.match(name)
        if m:
            kind, i = m.groups()
            hf = "input" if io == "past" else "output"
            spellings.update((p.format(io=io, hf=hf, i=i, kind=kind), name) for p in ORIGINAL_KV)
    return spellings


def _np_dtype(ort_type: str) -> np.dtype:
    names = {"float": np.float32, "float16": np.float16, "double": np.float64, "int64": np.int64,
             "int32": np.int32, "bool": np.bool_, "int8": np.int8, "uint8": np.uint8}
    inner = ort_type.removeprefix("tensor(").removesuffix(")")
    if inner not in names:
        raise InputError(f"verify: unsupported input type {ort_type}")
    return np.dtype(names[inner])


def _manifest_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        raise InputError(f"manifest: unknown dtype '{name}'") from None
