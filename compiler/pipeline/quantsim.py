"""`verify --quant SCHEME`: simulate MediaTek's quantisation of every NPU partition in onnxruntime.

    NPU partition ─► opset 21 copy ─► onnxruntime.quantization.quantize_static (QDQ; MinMax ranges
                     over OUT/calibration/<graph>.<partition>/*.npz) ─► quantised partition
    CPU partitions, host tables: float
    (at any size: `quantstream` hands the quantiser a stubbed graph, computes the ranges and streams
    the weights' codes from the one mapping of the weights every session here shares)

Scheme (MediaTek's names, `AxWy`): weights of MatMul/Gemm/Conv per output channel, symmetric, y bits
(int4 as codes in [-8, 7]); other constants (norm weights, biases, tables) per tensor, symmetric, x
bits; activations per tensor from the calibration ranges: 16-bit symmetric, 8-bit asymmetric.
`keep_fp` layers (mixed precision) get 16-bit weights and 16-bit activations inside the layer.

Then both pipelines run on the prompts through the reference runtime (`Generator`, graphs as their
partitions): teacher-forced (the quantised pipeline fed the float run's graph inputs) for cosine,
max abs error and top-1 agreement per graph output and the cosine of every decoder layer's output;
free-running for the greedy-token agreement with float.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from mtkc.backend.calibration_data import folder_name, read_sample, sample_files
from mtkc.contract import io
from mtkc.contract import mask as contract_mask
from mtkc.display import Progress
from mtkc.errors import InputError
from mtkc.pipeline import quantsmooth
from mtkc.pipeline.calibrate import npu_partitions
from mtkc.pipeline.quantmetrics import Agreement, forced, nll, real_rows, rows_of, windows
from mtkc.pipeline.quantplan import LM_HEAD, SCHEMES, Precision, Units, parse_units
from mtkc.pipeline.quantstream import Store, absolute, grid_scales, ranges, stubbed, with_codes
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.generate import Generator
from mtkc.runtime.partitioned import GraphRunner, partition_sessions, use_partitions

_OPAQUE = "mtkc.opaque"  # stand-in domain for ops without an ONNX schema while the opset is raised

MASK_RESOLUTION = 1000.0  # |mask value| above which 16-bit masked scores lose their fractional part


def weight_index(node: onnx.NodeProto) -> int | None:
    """Input index of the weight quantised per output channel (MatMul/Gemm/Conv input 1)."""
    return 1 if node.op_type in ("MatMul", "Gemm", "Conv") else None


def channel_axis(node: onnx.NodeProto, rank: int) -> int:
    """Output-channel axis of the weight: MatMul [.., K, N] -> last; Gemm [K, N] or transB [N, K]; Conv [O, ..]."""
    if node.op_type == "Gemm":
        trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans else 1
    return 0 if node.op_type == "Conv" else rank - 1


def per_channel_weights(graph: onnx.GraphProto) -> dict[str, int]:
    """Float constants used only as a MatMul/Gemm/Conv weight, on one channel axis: name -> axis."""
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    axes: dict[str, set] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in floats:
                axes.setdefault(name, set()).add(channel_axis(node, len(floats[name].dims)) if i == weight_index(node) else None)
    return {name: next(iter(a)) for name, a in axes.items() if len(a) == 1 and None not in a}


def overrides(graph: onnx.GraphProto, precision: Precision, absmax, unit) -> dict[str, list[dict]]:
    """onnxruntime `TensorQuantOverrides`: every float constant's precision and axis (from the scheme
    of the node using it; weights per output channel on MediaTek's grid from `absmax(tensor, axis)`),
    and the activations of raised units at their scheme's bits. `unit(node)`: the node's unit."""
    from onnxruntime.quantization import QuantType

    signed = {16: QuantType.QInt16, 8: QuantType.QInt8, 4: QuantType.QInt4}
    base_a = SCHEMES[precision.scheme][0]
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    result: dict[str, list[dict]] = {}
    for node in graph.node:
        scheme = precision.of(unit(node))
        if scheme is None:
            continue
        a_bits, w_bits = SCHEMES[scheme]
        for i, name in enumerate(node.input):
            if name not in floats or name in result:
                continue
            if i == weight_index(node):
                axis = channel_axis(node, len(floats[name].dims))
                result[name] = [{"quant_type": signed[w_bits], "axis": axis, "scale": np.float32(s), "zero_point": 0}
                                for s in grid_scales(absmax(floats[name], axis), w_bits)]
            else:
                result[name] = [{"quant_type": signed[a_bits], "symmetric": True}]
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    for node in graph.node:
        scheme = precision.of(unit(node))
        if scheme is None or SCHEMES[scheme][0] == base_a:
            continue
        for name in node.output:
            if name and users.get(name) and all(precision.of(unit(u)) == scheme for u in users[name]):
                a_bits = SCHEMES[scheme][0]
                result[name] = [{"quant_type": QuantType.QInt16, "symmetric": True} if a_bits == 16
                                else {"quant_type": QuantType.QUInt8, "symmetric": False}]
    return result


def raise_opset(proto: onnx.ModelProto, version: int = 21) -> onnx.ModelProto:
    """The model at opset `version` (16-bit Q/DQ need 21); ops without an ONNX schema (onnxruntime's
    SimplifiedLayerNormalization in the default domain) are carried through unchanged."""
    from onnx import defs, version_converter

    current = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), version)
    if current >= version:
        return proto
    opaque = [n for n in proto.graph.node if n.domain in ("", "ai.onnx") and not defs.has(n.op_type)]
    for node in opaque:
        node.domain = _OPAQUE
    proto.opset_import.append(onnx.helper.make_opsetid(_OPAQUE, 1))
    converted = version_converter.convert_version(proto, version)
    for node in converted.graph.node:
        if node.domain == _OPAQUE:
            node.domain = ""
    kept = [o for o in converted.opset_import if o.domain != _OPAQUE]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    return converted


class SampleReader:
    """onnxruntime `CalibrationDataReader` over one partition's stored samples (cast back to the
    input dtypes: `read_sample`). `set_range` lets the calibrator take them one at a time
    (`CalibStridedMinMax`: each sample's intermediate tensors are reduced to min/max before the
    next runs, so memory does not grow with the samples)."""

    def __init__(self, files: list[Path], inputs: list[dict], mask: tuple[float, float] | None = None):
        self.files, self.inputs = list(files), inputs
        self.position, self.end = 0, len(self.files)
        self.mask = mask  # (compiled value, value fed instead) in the additive mask input

    def set_range(self, start_index: int, end_index: int) -> None:
        self.position, self.end = start_index, min(end_index, len(self.files))

    def get_next(self):
        if self.position >= self.end:
            return None
        self.position += 1
        data = read_sample(self.files[self.position - 1], self.inputs)  # checked: untrusted OUT content
        return {k: swap_mask(v, self.mask) if k == io.ATTENTION_MASK else v for k, v in data.items()}

    def __len__(self) -> int:
        return len(self.files)


def swap_mask(value: np.ndarray, mask: tuple[float, float] | None) -> np.ndarray:
    """The additive mask with its masked entries (the compiled value) at the value quantisation uses."""
    if mask is None or mask[0] == mask[1]:
        return value
    return np.where(value == np.float32(mask[0]), np.float32(mask[1]), value).astype(value.dtype)


CODE_BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.INT8: 8, onnx.TensorProto.INT16: 16}


def partition_files(out: Path, manifest: dict, graph: dict, part: dict, samples: int | None) -> list[Path]:
    """The partition's stored samples; with `samples`, at most that many, evenly spaced."""
    files = sample_files(out, manifest, folder_name(graph, part))
    if samples and len(files) > samples:
        files = [files[k * len(files) // samples] for k in range(samples)]
    return files


def quantize_partition(store: Store, float_proto: onnx.ModelProto, ranges_path: Path, reader: SampleReader,
                       precision: Precision, folder: Path, stem: str, unit) -> onnx.ModelProto:
    """The partition quantised at `precision` (`quantstream`: onnxruntime's QDQ on the stubbed graph,
    its calibration ranges from `ranges_path`, then the weights' codes), held in memory. `unit(node)`:
    the node's unit."""
    import logging

    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    weights = per_channel_weights(float_proto.graph)
    tensor_overrides = overrides(float_proto.graph, precision, store.absmax, unit)
    excluded = [n.name for n in float_proto.graph.node if n.name and precision.of(unit(n)) is None]
    source, target = folder / f"{stem}.stubbed.onnx", folder / f"{stem}.q.onnx"
    onnx.save(stubbed(float_proto, weights, store), str(source))
    a_bits, w_bits = SCHEMES[precision.scheme]
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization logs advice through the root logger
    try:
        quantize_static(
            str(source), str(target), reader, quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QInt16 if a_bits == 16 else QuantType.QUInt8,
            weight_type={16: QuantType.QInt16, 8: QuantType.QInt8, 4: QuantType.QInt4}[w_bits],
            op_types_to_quantize=sorted({n.op_type for n in float_proto.graph.node}), nodes_to_exclude=excluded,
            calibrate_method=CalibrationMethod.MinMax, calibration_cache_path=str(ranges_path),
            extra_options={"ActivationSymmetric": a_bits == 16, "WeightSymmetric": True, "CalibStridedMinMax": 1,
                           "TensorQuantOverrides": tensor_overrides})
    finally:
        logging.getLogger().setLevel(quiet)
    return with_codes(onnx.load(str(target)), float_proto, weights, CODE_BITS.__getitem__, store)


def with_probes(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """`proto` also outputting the tensors `names` (layer probes)."""
    present = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in present)
    return proto


@dataclass
class QuantResult:
    scheme: str
    min_cosine: float
    keep_fp: list
    units: dict = field(default_factory=dict)  # raised units (a plan): unit -> scheme
    mask_value: float | None = None  # the additive mask value the quantised pipeline is fed
    smooth: float | None = None  # SmoothQuant alpha applied before calibration
    outputs: list[dict] = field(default_factory=list)  # teacher-forced, per graph output
    layers: list[dict] = field(default_factory=list)  # teacher-forced, each layer's output (error accumulated)
    own_cache: dict = field(default_factory=dict)  # logits on the quantised pipeline's own cache
    tokens: dict = field(default_factory=dict)  # free-running greedy agreement
    sensitivity: list[dict] = field(default_factory=list)  # each unit quantised alone
    perplexity: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def under_bar(self) -> list[dict]:
        return [o for o in self.outputs if o["cosine"] < self.min_cosine]

    @property
    def weak_layers(self) -> list:
        """The units whose quantisation alone costs the most: every unit under the bar alone, else the
        most sensitive ones (fewest to drop) when the whole model is under it."""
        alone = [e["unit"] for e in self.sensitivity if e["cosine"] < self.min_cosine]
        if alone or self.ok:
            return alone
        ranked = sorted(self.sensitivity, key=lambda e: e["sqnr_db"])
        return [ranked[0]["unit"]] if ranked else []

    @property
    def ok(self) -> bool:
        return not self.under_bar

    def suggestion(self) -> str | None:
        weak = ordered(set(self.weak_layers) | set(self.keep_fp))
        return f"--keep-fp {','.join(map(str, weak))}" if weak and set(weak) != set(self.keep_fp) else None

    def to_json(self) -> dict:
        return {**asdict(self), "units": {str(k): v for k, v in self.units.items()}, "ok": self.ok,
                "weak_layers": self.weak_layers, "suggest": self.suggestion()}


def ordered(units) -> list:
    return sorted((u for u in units if u != LM_HEAD)) + ([LM_HEAD] if LM_HEAD in units else [])


def parse_layers(text: str | None) -> list:
    return parse_units(text, "--keep-fp")


class Simulation:
    """One OUT's float pipeline, and quantised pipelines made from its calibration samples (the float
    copies and calibrated ranges shared by every precision, in `workdir`)."""

    def __init__(self, out: Path, workdir: Path, calibration_samples: int | None = None, smooth: float | None = None):
        self.out, self.workdir, self.samples, self.smooth = Path(out), Path(workdir), calibration_samples, smooth
        self.manifest = load_manifest(self.out)
        self.compiled_mask = contract_mask.value_of(self.manifest.get("options"))
        self.record = Units(self.out, self.manifest)  # each node's unit, as compile found them by structure
        self.probes: dict[tuple[str, str], dict[int, str]] = {}  # (graph, partition) -> layer -> tensor leaving it
        for graph in self.manifest.get("graphs", []):
            leaving = self.record.outputs[graph["name"]]
            for part in graph["partitions"]:
                made = {t for n in onnx.load(str(self.out / part["path"]), load_external_data=False).graph.node
                        for t in n.output}
                self.probes[graph["name"], part["id"]] = {i: t for i, t in leaving.items() if t in made}
        self.by_graph: dict[str, dict[int, str]] = {}
        for (g, _), found in self.probes.items():
            self.by_graph.setdefault(g, {}).update(found)
        self.captured: dict[str, dict[str, np.ndarray]] = {}
        self.store = Store(self.out, self.workdir)  # one mapping of every weights file, for every session here
        self.float_sessions = partition_sessions(self.out, self.manifest, self._capture, self._floating)
        self._floats: dict[tuple, tuple[onnx.ModelProto, Path]] = {}
        self._quant: dict[str, dict] = {}  # {precision@mask: {partition path: session}}: the last one

    def _capture(self, graph, part, inputs, values):
        self.captured.setdefault(graph["name"], {}).update(values)

    def _session(self, graph, part, proto: onnx.ModelProto, folder: Path, what: str):
        return self.store.sessions.model(with_probes(proto, list(self.probes[graph["name"], part["id"]].values())), folder,
                                         f"{graph['name']}/{part['id']} ({what})")

    def _floating(self, graph, part):
        path = self.out / part["path"]
        return self._session(graph, part, onnx.load(str(path), load_external_data=False), path.parent, "float")

    def float_copy(self, graph: dict, part: dict, folder: Path, mask: tuple[float, float]) -> tuple[onnx.ModelProto, Path]:
        """The NPU partition at opset 21 (smoothed first with `smooth`: its rewritten weights in a file
        of the work folder), held as a graph over the mapped weights, and its calibration ranges
        (onnxruntime's cache file); made once per folder, shared by every precision."""
        key = (folder, graph["name"], part["id"])
        if key not in self._floats:
            path = self.out / part["path"]
            proto = absolute(raise_opset(onnx.load(str(path), load_external_data=False)), path.parent)
            files = partition_files(self.out, self.manifest, graph, part, self.samples)
            what = f"{graph['name']}/{part['id']} (ranges)"

            def run_on(model):
                return self.store.sessions.model(model, self.workdir, what)

            if self.smooth is not None:
                reader = SampleReader(files[:: max(1, len(files) // quantsmooth.MAX_SAMPLES)][: quantsmooth.MAX_SAMPLES],
                                      part["inputs"], mask)
                writer = self.store.writer()
                try:
                    quantsmooth.smooth(proto, iter(reader.get_next, None), self.smooth, run_on, self.store.array,
                                       lambda value, name: writer.add(name, onnx.TensorProto.FLOAT, list(value.shape), [value]))
                finally:
                    writer.close()
            from onnxruntime.quantization.calibrate import save_tensors_data

            cache = folder / f"{graph['name']}.{part['id']}.ranges.json"
            save_tensors_data(ranges(proto, run_on, iter(SampleReader(files, part["inputs"], mask).get_next, None)), cache)
            self._floats[key] = (proto, cache)
        return self._floats[key]

    def quant_sessions(self, precision: Precision, mask_value: float, graphs: set[str] | None = None) -> dict:
        """Partition sessions of `graphs` (default: every graph) with their NPU partitions quantised at
        `precision`; the last precision's are kept, a graph's made at its first request (a 1-token
        comparison runs only the prefill graphs: the decode partitions are not quantised for it)."""
        key = f"{precision.key()}@{mask_value:g}"
        if key not in self._quant:
            self._quant = {key: {}}
        sessions = self._quant[key]
        folder = self.workdir / f"mask{mask_value:g}-smooth{self.smooth}"  # float copies and ranges for these
        folder.mkdir(exist_ok=True)
        mask = (self.compiled_mask, mask_value)

        def make(graph, part):
            if part["target"] != "npu":
                return self._floating(graph, part)
            float_proto, cache = self.float_copy(graph, part, folder, mask)
            files = partition_files(self.out, self.manifest, graph, part, self.samples)
            proto = quantize_partition(self.store, float_proto, cache, SampleReader(files, part["inputs"], mask),
                                       precision, folder, f"{graph['name']}.{part['id']}",
                                       lambda node, name=graph["name"]: self.record.of(name, node.name))
            return self._session(graph, part, proto, self.workdir, precision.scheme)

        wanted = [g for g in self.manifest.get("graphs", []) if (graphs is None or g["name"] in graphs)
                  and any(self.out / p["path"] not in sessions for p in g["partitions"])]
        sessions.update(partition_sessions(self.out, {"graphs": wanted}, self._capture, make))
        return sessions

    def generator(self, sessions: dict, mask_value: float | None = None) -> Generator:
        gen = Generator(self.out, mask_value=mask_value, sessions=self.store.sessions)
        use_partitions(gen, self.manifest, sessions)
        return gen

    def compare(self, precision: Precision, prompts: list[list[int]], new_tokens: int, mask_value: float,
                full: bool = True) -> dict:
        """Teacher-forced figures per graph output and layer (the quantised graphs fed the float run's
        inputs, real rows only); with `full`, also the quantised pipeline on its own cache (logits over
        the float tokens) and free-running (its greedy tokens against float's)."""
        reference = Generator(self.out, sessions=self.store.sessions)
        runs = None if full or new_tokens > 1 else {stage.name for stage in reference.prefill}  # 1 token: prefill only
        quant_sessions = self.quant_sessions(precision, mask_value, runs)
        stats: dict[tuple[str, str], Agreement] = {}
        layer_stats: dict[tuple[str, int], Agreement] = {}
        sim, graphs = self, {g["name"]: g for g in self.manifest["graphs"]}
        mask = (self.compiled_mask, mask_value)

        class Compare(GraphRunner):
            """Runs the float pipeline (returned) and the quantised one on the same graph inputs."""

            def run(self, names, feed):
                sim.captured.clear()
                ref = dict(zip(names, GraphRunner(self.out, self.graph, sim.float_sessions).run(names, feed)))
                ref_probe = sim.captured.pop(self.graph["name"], {})
                qfeed = {k: swap_mask(v, mask) if k == io.ATTENTION_MASK else v for k, v in feed.items()}
                quant = dict(zip(names, GraphRunner(self.out, self.graph, quant_sessions).run(names, qfeed)))
                quant_probe = sim.captured.pop(self.graph["name"], {})
                width = next((np.shape(v)[1] for k, v in feed.items() if k in (io.INPUT_IDS, io.HIDDEN_STATES)), None)
                rows = real_rows(feed, width) if width else None
                pick = (lambda v: rows_of(v, rows)) if rows is not None else np.asarray
                for name in names:
                    stats.setdefault((self.graph["name"], name), Agreement()).add(
                        pick(quant[name]), pick(ref[name]), name == io.LOGITS)
                for layer, tensor in sim.by_graph.get(self.graph["name"], {}).items():
                    if tensor in ref_probe and tensor in quant_probe:
                        layer_stats.setdefault((self.graph["name"], layer), Agreement()).add(
                            pick(quant_probe[tensor]), pick(ref_probe[tensor]))
                return [ref[n] for n in names]

        for stage in reference.prefill + reference.decode:
            stage.session = Compare(self.out, graphs[stage.name], {})
        quantised = self.generator(quant_sessions, mask_value) if full else None
        own, per_prompt = Agreement(), []
        with Progress(f"verify --quant {precision.scheme}", total=len(prompts), unit="prompt") as progress:
            for ids in prompts:
                seen: list[np.ndarray] = []
                progress.advance()
                try:
                    want = reference.generate(ids, new_tokens, observe=seen.append)
                    if quantised is None:
                        continue
                    own.add(forced(quantised, ids, want[:-1]), np.concatenate(seen), top1=True)
                    got = quantised.generate(ids, new_tokens)
                except InputError as exc:
                    raise InputError(f"prompt of {len(ids)} tokens: {exc}") from None
                same = [a == b for a, b in zip(want, got)]
                per_prompt.append({"float": want, "quant": got, "agreement": float(np.mean(same)) if same else 1.0,
                                   "prefix": next((k for k, s in enumerate(same) if not s), len(same))})
        outputs = [{"graph": g, "output": o, **s.figures()} for (g, o), s in stats.items()]
        by_layer: dict[int, dict[str, float]] = {}
        for (g, layer), s in sorted(layer_stats.items(), key=lambda x: (x[0][1], x[0][0])):
            by_layer.setdefault(layer, {})[g] = s.cosine
        figures = {"outputs": outputs,
                   "layers": [{"layer": k, "cosine": min(v.values()), "graphs": v} for k, v in sorted(by_layer.items())]}
        if full:
            figures["own_cache"] = own.figures()
            figures["tokens"] = {"new_tokens": new_tokens, "prompts": len(prompts),
                                 "agreement": float(np.mean([p["agreement"] for p in per_prompt])) if per_prompt else None,
                                 "prefix": float(np.mean([p["prefix"] for p in per_prompt])) if per_prompt else None,
                                 "per_prompt": per_prompt}
        return figures

    def units(self) -> list:
        """Every quantisable unit of the NPU partitions: decoder layers, then the LM head."""
        found = set()
        for graph, part in npu_partitions(self.manifest):
            proto = onnx.load(str(self.out / part["path"]), load_external_data=False).graph
            found |= {self.record.of(graph["name"], n.name) for n in proto.node} - {None}
        return ordered(found)

    def sensitivity(self, scheme: str, prompts: list[list[int]], mask_value: float) -> list[dict]:
        """Each unit quantised alone at `scheme` (everything else float): prefill logits' SQNR and cosine."""
        rows = []
        for unit in self.units():
            figures = self.compare(Precision(scheme, {unit: scheme}, alone=True), prompts, 1, mask_value, full=False)
            logits = next(o for o in figures["outputs"] if o["output"] == io.LOGITS and o["graph"].startswith("prefill"))
            rows.append({"unit": unit, "cosine": logits["cosine"], "sqnr_db": logits["sqnr_db"]})
        return rows

    def perplexity(self, ids: list[int], sessions: dict | None, mask_value: float | None, limit: int) -> tuple[float, int]:
        """(perplexity, scored tokens) of the float pipeline (`sessions` None) or a quantised one, on
        held-out `ids` in cache-length windows on its own cache."""
        gen = self.generator(sessions if sessions is not None else self.float_sessions, mask_value)
        total, count = 0.0, 0
        for window in windows(ids, gen, limit):
            loss, n = nll(forced(gen, window), window)
            total, count = total + loss, count + n
        self.captured.clear()
        return (float(np.exp(total / count)) if count else float("nan")), count

    def proven_mask(self, scheme: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, str | None]:
        """The mask value the quantised pipeline is fed, and a note. The compiled value when it is small
        enough not to set the masked scores' range; else the first of `QUANT_MASKS[a_bits]` under which
        the FLOAT pipeline gives float's logits (cosine >= 1 - 1e-6) and greedy tokens on the prompts."""
        value = self.compiled_mask
        if abs(value) <= MASK_RESOLUTION:
            return value, None
        for candidate in QUANT_MASKS[SCHEMES[scheme][0]]:
            base, trial = self.generator(self.float_sessions), self.generator(self.float_sessions, candidate)
            agree, same = Agreement(), True
            for ids in prompts:
                a, b = [], []
                same &= base.generate(ids, new_tokens, observe=a.append) == trial.generate(ids, new_tokens, observe=b.append)
                agree.add(np.concatenate(b), np.concatenate(a))
            self.captured.clear()
            if same and agree.cosine >= 1 - 1e-6:
                return candidate, (f"the compiled mask value {value:g} would set the masked scores' quantisation range "
                                   f"(a {abs(value) / (2 ** SCHEMES[scheme][0] - 1):.3g} step); the quantised pipeline is "
                                   f"fed {candidate:g}, proven on the float pipeline (same tokens, logits cosine "
                                   f"{agree.cosine:.7f}); the device runtime must feed {candidate:g}")
        return value, (f"the mask value {value:g} sets the masked scores' range: no smaller value keeps the float "
                       "pipeline's tokens, so quantised attention scores are coarse")


QUANT_MASKS = {16: (-100.0,), 8: (-50.0, -100.0)}  # candidate masked values per activation width, tried in order
EVAL_TOKENS = 2048  # held-out tokens scored by --eval (each pipeline runs them once, in cache-length windows)


def simulate(out: str | Path, scheme: str, prompts: list[list[int]], new_tokens: int = 16,
             keep_fp: list | None = None, min_cosine: float = 0.99, calibration_samples: int | None = None,
             units: dict | None = None, eval_ids: list[int] | None = None, sensitivity: bool | None = None,
             smooth: float | None = None) -> QuantResult:
    """Quantise every NPU partition with `scheme` (`units`/`keep_fp` raised) and compare with float on
    `prompts` (see module doc). `sensitivity`: each unit alone (default: when under the bar).
    `smooth`: SmoothQuant's alpha, the float rewrite of the NPU partitions before calibration."""
    if scheme not in SCHEMES:
        raise InputError(f"--quant {scheme}: expected one of {', '.join(SCHEMES)}")
    keep = ordered(set(keep_fp or []))
    raised_units = {**(units or {}), **{u: "A16W16" for u in keep}}
    with tempfile.TemporaryDirectory(prefix="mtkc-quant-") as tmp:
        sim = Simulation(Path(out), Path(tmp), calibration_samples, smooth)
        return run_simulation(sim, scheme, prompts, new_tokens, keep, raised_units, min_cosine, eval_ids, sensitivity)


def run_simulation(sim: Simulation, scheme: str, prompts, new_tokens, keep, raised_units, min_cosine,
                   eval_ids=None, sensitivity=None) -> QuantResult:
    result = QuantResult(scheme, min_cosine, keep, raised_units, smooth=sim.smooth)
    present = sim.units()
    absent = [u for u in raised_units if u not in present]
    if absent:
        have = ", ".join(map(str, present)) or "none"
        raise InputError(f"unit '{absent[0]}' (--keep-fp / --plan) is in no NPU partition of {sim.out} (its units: {have})")
    if not any(sim.probes.values()):
        result.notes.append("the manifest records no decoder layer output: no per-layer cosine")
    mask_value, note = sim.proven_mask(scheme, prompts, new_tokens)
    result.mask_value = mask_value
    if note:
        result.notes.append(note)
    precision = Precision(scheme, raised_units)
    figures = sim.compare(precision, prompts, new_tokens, mask_value)
    result.outputs, result.layers = figures["outputs"], figures["layers"]
    result.own_cache, result.tokens = figures["own_cache"], figures["tokens"]
    if sensitivity or (sensitivity is None and result.under_bar):
        result.sensitivity = sim.sensitivity(scheme, prompts, mask_value)
    if eval_ids:
        fp, n = sim.perplexity(eval_ids, None, None, EVAL_TOKENS)
        qp, _ = sim.perplexity(eval_ids, sim.quant_sessions(precision, mask_value), mask_value, EVAL_TOKENS)
        result.perplexity = {"float": fp, "quant": qp, "tokens": n}
    return result


def format_text(result: QuantResult, every_output: bool = False) -> str:
    """Each graph's logits row and one row for its cache outputs (their worst figures), the layers'
    accumulated error first/worst/last, and the units under the bar or most sensitive; `every_output`
    (-v): a row per output, a line per layer and per unit. --format json has everything."""
    rows = [("graph", "output", "cosine", "SQNR dB", "worst call", "max abs", "top-1", "status")]
    for graph in dict.fromkeys(o["graph"] for o in result.outputs):
        outs = [o for o in result.outputs if o["graph"] == graph]
        caches = [o for o in outs if o["output"].startswith("present_")]
        if not every_output and len(caches) > 1:
            under = sum(o["cosine"] < result.min_cosine for o in caches)
            worst = {"graph": graph, "output": f"{len(caches)} caches", "cosine": min(o["cosine"] for o in caches),
                     "sqnr_db": min(o["sqnr_db"] for o in caches),
                     "worst_call_cosine": min(o["worst_call_cosine"] for o in caches),
                     "max_abs": max(o["max_abs"] for o in caches), "status": f"UNDER BAR ({under})" if under else "ok"}
            outs = [o for o in outs if o not in caches] + [worst]
        for o in outs:
            rows.append((o["graph"], o["output"], f"{o['cosine']:.6f}", f"{o['sqnr_db']:.1f}",
                         f"{o['worst_call_cosine']:.6f}", f"{o['max_abs']:.3g}", f"{o['top1']:.3f}" if "top1" in o else "-",
                         o.get("status") or ("ok" if o["cosine"] >= result.min_cosine else "UNDER BAR")))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    raised = ", ".join(f"{u} {s}" for u, s in result.units.items())
    lines = [f"quantisation simulation {result.scheme}" + (f", raised: {raised}" if raised else "")
             + (f", smoothed (alpha {result.smooth:g})" if result.smooth is not None else "")
             + " (teacher-forced: the quantised graphs fed float's inputs; real positions only)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    layers = result.layers
    if every_output or len(layers) <= 3:
        for entry in layers:
            lines.append(f"layer {entry['layer']}: output cosine {entry['cosine']:.6f} (error accumulated through the "
                         "layers before)")
    elif layers:
        low = min(layers, key=lambda e: e["cosine"])
        lines.append(f"layers {layers[0]['layer']}-{layers[-1]['layer']}: output cosine {layers[0]['cosine']:.6f} after "
                     f"layer {layers[0]['layer']}, lowest {low['cosine']:.6f} after layer {low['layer']}, "
                     f"{layers[-1]['cosine']:.6f} after layer {layers[-1]['layer']} (error accumulated; -v: each layer)")
    shown = result.sensitivity
    if not every_output and len(shown) > 4:
        ranked = sorted(shown, key=lambda e: e["sqnr_db"])
        keep = {id(e) for e in ranked[:3]} | {id(e) for e in shown if e["cosine"] < result.min_cosine}
        rest = [e for e in shown if id(e) not in keep]
        shown = [e for e in shown if id(e) in keep]
    else:
        rest = []
    for entry in shown:
        mark = "" if entry["cosine"] >= result.min_cosine else "  UNDER BAR"
        lines.append(f"sensitivity {entry['unit']} quantised alone: logits cosine {entry['cosine']:.6f}, "
                     f"SQNR {entry['sqnr_db']:.1f} dB{mark}")
    if rest:
        lines.append(f"sensitivity of the other {len(rest)} units alone: logits cosine >= "
                     f"{min(e['cosine'] for e in rest):.6f}, SQNR >= {min(e['sqnr_db'] for e in rest):.1f} dB (-v: each)")
    own = result.own_cache
    if own:
        lines.append(f"own quantised cache: logits cosine {own['cosine']:.6f}, SQNR {own['sqnr_db']:.1f} dB, "
                     f"top-1 {own.get('top1', 0):.3f} over {own.get('positions', 0)} positions")
    t = result.tokens
    if t.get("prompts"):
        lines.append(f"free-running greedy tokens: {t['agreement']:.3f} agreement with float over {t['prompts']} prompt(s) x "
                     f"{t['new_tokens']} new tokens (first divergence after {t['prefix']:.1f} tokens on average)")
    p = result.perplexity
    if p:
        lines.append(f"perplexity over {p['tokens']} held-out tokens: float {p['float']:.3f}, quantised {p['quant']:.3f}")
    lines += [f"note: {n}" for n in result.notes]
    if result.weak_layers:
        lines.append(f"most sensitive: {', '.join(map(str, result.weak_layers))}; try {result.suggestion() or 'A16W16'}")
    verdict = "ok" if result.ok else f"UNDER BAR in {len(result.under_bar)} output(s)"
    lines.append(f"{verdict} (min cosine {result.min_cosine:g})")
    return "\n".join(lines)
