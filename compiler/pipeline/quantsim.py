"""`verify --quant SCHEME`: simulate MediaTek's quantisation of every NPU partition in onnxruntime.

    NPU partition ─► opset 21 copy ─► onnxruntime.quantization.quantize_static (QDQ; MinMax calibrator
                     over OUT/calibration/<graph>.<partition>/*.npz) ─► quantised partition
    CPU partitions, host tables: float

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

import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from mtkc.backend.calibration_data import folder_name, read_sample, sample_files
from mtkc.contract import mask as contract_mask
from mtkc.display import Progress
from mtkc.errors import InputError
from mtkc.ir import weights
from mtkc.ir.execute import session
from mtkc.pipeline.calibrate import npu_partitions, reopen_as_partitions
from mtkc.pipeline.verify import load_manifest
from mtkc.runtime.generate import Generator
from mtkc.runtime.partitioned import GraphRunner, partition_sessions, use_partitions

SCHEMES = {"A16W16": (16, 16), "A16W8": (16, 8), "A16W4": (16, 4), "A8W8": (8, 8), "A8W4": (8, 4)}
LAYER = re.compile(r"layers[./](\d+)[./]")
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


def layer_of(node: onnx.NodeProto) -> int | None:
    m = LAYER.search(node.name)
    return int(m[1]) if m else None


def layer_outputs(graph: onnx.GraphProto) -> dict[int, str]:
    """Each decoder layer's output: the first output of its last node (exporter node names `layers.<i>/`)."""
    last: dict[int, str] = {}
    for node in graph.node:
        i = layer_of(node)
        if i is not None and node.output:
            last[i] = node.output[0]
    return dict(sorted(last.items()))


def parse_layers(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InputError(f"--keep-fp '{text}': expected comma-separated layer numbers, e.g. 0,3") from None
    if any(x < 0 for x in layers):
        raise InputError(f"--keep-fp '{text}': layer numbers are >= 0")
    return layers


def overrides(graph: onnx.GraphProto, scheme: str, keep: set[int], base_dir: str = "") -> dict[str, list[dict]]:
    """onnxruntime `TensorQuantOverrides`: every float constant's precision and axis, and the
    activations inside `keep` layers at 16 bits. External weights are read from `base_dir`, one at a time."""
    from onnxruntime.quantization import QuantType

    a_bits, w_bits = SCHEMES[scheme]
    signed = {16: QuantType.QInt16, 8: QuantType.QInt8, 4: QuantType.QInt4}
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    result: dict[str, list[dict]] = {}
    for node in graph.node:
        kept = layer_of(node) in keep
        for k, name in enumerate(node.input):
            if name not in floats or name in result:
                continue
            if k == weight_index(node):
                bits = 16 if kept else w_bits
                result[name] = channel_scales(floats[name], channel_axis(node, len(floats[name].dims)), bits, signed[bits],
                                              base_dir)
            else:
                result[name] = [{"quant_type": signed[16 if kept else a_bits], "symmetric": True}]
    if keep and a_bits != 16:
        users: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                users.setdefault(name, []).append(node)
        for node in graph.node:
            if layer_of(node) in keep:
                for name in node.output:
                    if name and users.get(name) and all(layer_of(u) in keep for u in users[name]):
                        result[name] = [{"quant_type": QuantType.QInt16, "symmetric": True}]
    return result


def channel_scales(weight: onnx.TensorProto, axis: int, bits: int, qtype, base_dir: str = "") -> list[dict]:
    """Per-output-channel overrides on MediaTek's grid (torch's symmetric observer): codes in
    [-2^(b-1), 2^(b-1)-1], scale = absmax / ((qmax - qmin) / 2). onnxruntime's own symmetric int8/16
    range drops the lowest code (scale absmax/127), a different grid."""
    from onnx import numpy_helper

    values = np.moveaxis(numpy_helper.to_array(weight, base_dir), axis, 0)
    absmax = np.abs(values.reshape(values.shape[0], -1)).max(axis=1)
    scales = absmax / ((2 ** bits - 1) / 2)
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    return [{"quant_type": qtype, "axis": axis, "scale": np.float32(s), "zero_point": 0} for s in scales]


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

    def __init__(self, files: list[Path], inputs: list[dict]):
        self.files, self.inputs = list(files), inputs
        self.position, self.end = 0, len(self.files)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.position, self.end = start_index, min(end_index, len(self.files))

    def get_next(self):
        if self.position >= self.end:
            return None
        self.position += 1
        return read_sample(self.files[self.position - 1], self.inputs)  # checked: untrusted OUT content

    def __len__(self) -> int:
        return len(self.files)


def quantize_partition(out: Path, manifest: dict, graph: dict, part: dict, scheme: str, keep: set[int],
                       workdir: Path, samples: int | None = None) -> Path:
    """Write the quantised copy of one NPU partition into `workdir`; returns its path.
    `samples`: calibrate on at most that many stored samples, evenly spaced (default: all)."""
    import logging

    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    files = sample_files(out, manifest, folder_name(graph, part))
    if samples and len(files) > samples:
        files = [files[k * len(files) // samples] for k in range(samples)]
    source = float_copy(out / part["path"], workdir / f"{graph['name']}.{part['id']}.float.onnx")
    proto = onnx.load(str(source), load_external_data=False)
    op_types = sorted({n.op_type for n in proto.graph.node})
    tensor_overrides = overrides(proto.graph, scheme, keep, base_dir=str(workdir))
    del proto
    target = workdir / f"{graph['name']}.{part['id']}.{scheme}.onnx"
    a_bits, w_bits = SCHEMES[scheme]
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization logs advice through the root logger
    try:
        quantize_static(
            str(source), str(target), SampleReader(files, part["inputs"]), quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QInt16 if a_bits == 16 else QuantType.QUInt8,
            weight_type={16: QuantType.QInt16, 8: QuantType.QInt8, 4: QuantType.QInt4}[w_bits],
            op_types_to_quantize=op_types,
            calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
            extra_options={"ActivationSymmetric": a_bits == 16, "WeightSymmetric": True, "CalibStridedMinMax": 1,
                           "TensorQuantOverrides": tensor_overrides})
    finally:
        logging.getLogger().setLevel(quiet)
    return target


def float_copy(partition: Path, path: Path) -> Path:
    """The partition at opset 21 as `path`, its weights copied file to file into `<path.name>.data`
    (onnx refuses links to OUT's weights.bin; no weight is held in memory, no proto serialised whole)."""
    proto = raise_opset(onnx.load(str(partition), load_external_data=False))
    weights.save(gs.import_onnx(proto), partition.parent, path)
    return path

def with_outputs(path: Path, names: list[str], root: Path):
    """An ORT session of the model at `path` that also outputs the tensors `names` (layer probes)."""
    proto = onnx.load(str(path), load_external_data=False)
    present = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in present)
    return session(proto, root)


@dataclass
class Agreement:
    """Running comparison of one tensor, quantised vs float, over every call."""

    dot: float = 0.0
    norm_q: float = 0.0
    norm_f: float = 0.0
    max_abs: float = 0.0
    worst: float = 1.0  # lowest cosine of a single call
    top1: int = 0
    rows: int = 0

    def add(self, quant: np.ndarray, ref: np.ndarray, rows: bool = False) -> None:
        q, f = np.asarray(quant, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
        self.dot += float(q @ f)
        self.norm_q += float(q @ q)
        self.norm_f += float(f @ f)
        self.max_abs = max(self.max_abs, float(np.abs(q - f).max()) if q.size else 0.0)
        self.worst = min(self.worst, _cosine(float(q @ f), float(q @ q), float(f @ f)))
        if rows:
            a, b = np.asarray(quant), np.asarray(ref)
            a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            self.top1 += int((a.argmax(-1) == b.argmax(-1)).sum())
            self.rows += a.shape[0]

    @property
    def cosine(self) -> float:
        return _cosine(self.dot, self.norm_q, self.norm_f)


@dataclass
class QuantResult:
    scheme: str
    min_cosine: float
    keep_fp: list[int]
    outputs: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    tokens: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def under_bar(self) -> list[dict]:
        return [o for o in self.outputs if o["cosine"] < self.min_cosine]

    @property
    def weak_layers(self) -> list[int]:
        return [entry["layer"] for entry in self.layers if entry["cosine"] < self.min_cosine]

    @property
    def ok(self) -> bool:
        return not self.under_bar

    def suggestion(self) -> str | None:
        weak = sorted(set(self.weak_layers) | set(self.keep_fp))
        return f"--keep-fp {','.join(map(str, weak))}" if weak and set(weak) != set(self.keep_fp) else None

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "weak_layers": self.weak_layers, "suggest": self.suggestion()}


def simulate(out: str | Path, scheme: str, prompts: list[list[int]], new_tokens: int = 16,
             keep_fp: list[int] | None = None, min_cosine: float = 0.99,
             calibration_samples: int | None = None) -> QuantResult:
    """Quantise every NPU partition with `scheme` and compare with float on `prompts` (see module doc)."""
    if scheme not in SCHEMES:
        raise InputError(f"--quant {scheme}: expected one of {', '.join(SCHEMES)}")
    out = Path(out)
    manifest = load_manifest(out)
    keep = set(keep_fp or [])
    result = QuantResult(scheme, min_cosine, sorted(keep))
    mask_value = contract_mask.value_of(manifest.get("options"))
    if abs(mask_value) > MASK_RESOLUTION:
        result.notes.append(f"the additive mask value {mask_value:g} sets the per-tensor range of the masked scores, "
                            f"a step of {abs(mask_value) / 32767:.2g} at 16 bits; compile with MediaTek's "
                            "--mask-value=-100 when `mtkc verify` passes with it")
    probes: dict[tuple[str, str], dict[int, str]] = {}  # (graph, partition) -> layer -> tensor
    for graph in manifest.get("graphs", []):
        for part in graph["partitions"]:
            probes[graph["name"], part["id"]] = layer_outputs(onnx.load(str(out / part["path"]), load_external_data=False).graph)
    by_graph: dict[str, dict[int, str]] = {}
    for (g, _), found in probes.items():
        by_graph.setdefault(g, {}).update(found)
    if not any(probes.values()):
        result.notes.append("no decoder layer found by node name (layers.<i>/): no per-layer cosine")
    captured: dict[str, dict[str, np.ndarray]] = {}

    def capture(graph, part, inputs, values):
        captured.setdefault(graph["name"], {}).update(values)

    with tempfile.TemporaryDirectory(prefix="mtkc-quant-") as tmp:
        quantized = {}
        with Progress(f"verify --quant {scheme}: quantising", total=len(npu_partitions(manifest)), unit="partition") as progress:
            for graph, part in npu_partitions(manifest):
                quantized[graph["name"], part["id"]] = quantize_partition(
                    out, manifest, graph, part, scheme, keep, Path(tmp), calibration_samples)
                progress.advance()

        def floating(graph, part):
            path = out / part["path"]
            return with_outputs(path, list(probes[graph["name"], part["id"]].values()), path.parent)

        def quant(graph, part):
            if part["target"] != "npu":
                return floating(graph, part)
            path = quantized[graph["name"], part["id"]]
            return with_outputs(path, list(probes[graph["name"], part["id"]].values()), path.parent)

        float_sessions = partition_sessions(out, manifest, capture, floating)
        quant_sessions = partition_sessions(out, manifest, capture, quant)
        stats: dict[tuple[str, str], Agreement] = {}
        layer_stats: dict[tuple[str, int], Agreement] = {}

        class Compare(GraphRunner):
            """Runs the float pipeline (returned) and the quantised one on the same graph inputs."""

            def run(self, names, feed):
                captured.clear()
                ref = dict(zip(names, GraphRunner(self.out, self.graph, float_sessions).run(names, feed)))
                ref_probe = captured.pop(self.graph["name"], {})
                quant = dict(zip(names, GraphRunner(self.out, self.graph, quant_sessions).run(names, feed)))
                quant_probe = captured.pop(self.graph["name"], {})
                for name in names:
                    stats.setdefault((self.graph["name"], name), Agreement()).add(quant[name], ref[name], name == "logits")
                for layer, tensor in by_graph.get(self.graph["name"], {}).items():
                    if tensor in ref_probe and tensor in quant_probe:
                        layer_stats.setdefault((self.graph["name"], layer), Agreement()).add(quant_probe[tensor], ref_probe[tensor])
                return [ref[n] for n in names]

        reference = Generator(out)
        reopen_as_partitions(reference)  # its whole-graph sessions are not kept beside the partitions'
        for stage in reference.prefill + reference.decode:
            stage.session = Compare(out, next(g for g in manifest["graphs"] if g["name"] == stage.name), {})
        quantised = Generator(out)
        reopen_as_partitions(quantised)
        use_partitions(quantised, manifest, quant_sessions)
        per_prompt = []
        with Progress(f"verify --quant {scheme}", total=len(prompts), unit="prompt") as progress:
            for prompt in prompts:
                ids = getattr(prompt, "ids", prompt)  # a `Prompt` (naming where it came from) or its ids
                try:
                    want = reference.generate(ids, new_tokens)
                    got = quantised.generate(ids, new_tokens)
                except InputError as exc:
                    raise InputError(f"{getattr(prompt, 'where', f'prompt of {len(ids)} tokens')}: {exc}") from None
                same = [a == b for a, b in zip(want, got)]
                per_prompt.append({"float": want, "quant": got, "agreement": float(np.mean(same)) if same else 1.0,
                                   "prefix": next((k for k, s in enumerate(same) if not s), len(same))})
                progress.advance()
    result.outputs = [{"graph": g, "output": o, "cosine": s.cosine, "worst_call_cosine": s.worst, "max_abs": s.max_abs,
                       **({"top1": s.top1 / s.rows} if s.rows else {})} for (g, o), s in stats.items()]
    by_layer: dict[int, dict[str, float]] = {}
    for (g, layer), s in sorted(layer_stats.items(), key=lambda x: (x[0][1], x[0][0])):
        by_layer.setdefault(layer, {})[g] = s.cosine
    result.layers = [{"layer": k, "cosine": min(v.values()), "graphs": v} for k, v in sorted(by_layer.items())]
    result.tokens = {"new_tokens": new_tokens, "prompts": len(prompts),
                     "agreement": float(np.mean([p["agreement"] for p in per_prompt])) if per_prompt else None,
                     "prefix": float(np.mean([p["prefix"] for p in per_prompt])) if per_prompt else None,
                     "per_prompt": per_prompt}
    return result


def format_text(result: QuantResult) -> str:
    rows = [("graph", "output", "cosine", "worst call", "max abs", "top-1", "status")]
    for o in result.outputs:
        rows.append((o["graph"], o["output"], f"{o['cosine']:.6f}", f"{o['worst_call_cosine']:.6f}", f"{o['max_abs']:.3g}",
                     f"{o['top1']:.3f}" if "top1" in o else "-", "ok" if o["cosine"] >= result.min_cosine else "UNDER BAR"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [f"quantisation simulation {result.scheme}" + (f", --keep-fp {','.join(map(str, result.keep_fp))}" if result.keep_fp else "")]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for entry in result.layers:
        mark = "" if entry["cosine"] >= result.min_cosine else "  UNDER BAR"
        lines.append(f"layer {entry['layer']}: cosine {entry['cosine']:.6f}{mark}")
    t = result.tokens
    if t.get("prompts"):
        lines.append(f"greedy tokens: {t['agreement']:.3f} agreement with float over {t['prompts']} prompt(s) x "
                     f"{t['new_tokens']} new tokens (first divergence after {t['prefix']:.1f} tokens on average)")
    lines += [f"note: {n}" for n in result.notes]
    if result.weak_layers:
        lines.append(f"layers under the bar: {', '.join(map(str, result.weak_layers))}; try {result.suggestion() or 'A16W16'}")
    verdict = "ok" if result.ok else f"UNDER BAR in {len(result.under_bar)} output(s)"
    lines.append(f"{verdict} (min cosine {result.min_cosine:g})")
    return "\n".join(lines)


def _cosine(dot: float, nq: float, nf: float) -> float:
    if nq == 0 and nf == 0:
        return 1.0
    return dot / np.sqrt(nq * nf) if nq and nf else 0.0
