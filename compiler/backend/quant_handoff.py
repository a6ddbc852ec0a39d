"""A hand-off that quantises: MediaTek's converter fed each NPU partition's calibration samples.

    mtkc convert OUT --quant A16W4      (after `mtkc calibrate OUT`)
      per NPU partition: mtk_converter.OnnxConverter(partition.onnx)
                           quantize = True, use_per_output_channel_quantization = True
                           calibration_data_gen = the partition's OUT/calibration/<graph>.<partition>/*.npz
                                                  (inputs in the partition's input order, each cast to
                                                  its input dtype: float32 is stored as float16)
                           precision_proportion = {PRECISION[scheme]: 1.0}
                         -> .tflite -> ncc-tflite (the SDK table's compile command) -> .dla

The converter step is MediaTek's Python API (its CLI takes no calibration data), written into
convert.sh so a user with the SDK runs exactly these settings; with `--converter-cmd` the user's
command gets `{calibration}` (the samples folder) and `{precision}`. Nothing runs when the SDK is
absent, and nothing pretends it did.

With a mixed-precision plan (`mtkc convert --plan quant-plan.json`, written by `verify --quant --plan`)
`precision_proportion` holds each precision's share of the NPU weights (`sym4W_sym16A=0.8,sym8W_sym16A=0.2`
as `{precision}`) and the manifest's `quant.plan` names every raised layer and its MatMul nodes: the
converter's proportions are MediaTek's attested knob; which ops it raises is its choice.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass

from mtkc.backend import handoff

# precision_proportion keys. Public code shows only "sym8W_sym16A" (8-bit weights, 16-bit
# activations); the others follow its pattern (inferred, not attested).
PRECISION = {"A16W16": "sym16W_sym16A", "A16W8": "sym8W_sym16A", "A16W4": "sym4W_sym16A",
             "A8W8": "sym8W_asym8A", "A8W4": "sym4W_asym8A"}
ATTESTED = {"sym8W_sym16A"}

PY_QUANT = """\
import glob, json, sys
import numpy as np, onnx, mtk_converter
src, dst, names, shapes, calibration, precision, spec = sys.argv[1:8]
names = json.loads(names)
graph = onnx.load(src, load_external_data=False).graph
dtypes = dict((i.name, onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in graph.input)
converter = mtk_converter.OnnxConverter.from_model_proto_file(
    src, input_names=names,
    input_shapes=[[int(d) for d in s.split(',') if d] for s in shapes.split(':')])

def samples():
    for path in sorted(glob.glob(calibration + '/*.npz')):
        with np.load(path, allow_pickle=False) as data:  # float16 samples of float32 inputs: cast back
            yield [np.asarray(data[name], dtypes[name]) for name in names]

converter.quantize = True
converter.use_per_output_channel_quantization = True
converter.calibration_data_gen = samples
converter.precision_proportion = dict((k, float(v or 1)) for k, _, v in (p.partition('=') for p in precision.split(',')))
converter.convert_to_tflite(output_file=dst, tflite_op_export_spec=spec)
"""


@dataclass(frozen=True)
class Quant:
    """The quantisation settings of one hand-off."""

    scheme: str
    plan: dict | None = None  # a mixed-precision plan: {"units": {unit: scheme}, "proportion": {precision: share}}

    @property
    def proportion(self) -> dict[str, float]:
        return dict((self.plan or {}).get("proportion") or {PRECISION[self.scheme]: 1.0})

    @property
    def precision(self) -> str:
        """`{precision}`: the scheme's precision key, or `key=share,...` (MediaTek's precision_proportion) for a plan."""
        if not self.plan:
            return PRECISION[self.scheme]
        return ",".join(f"{k}={v:g}" for k, v in sorted(self.proportion.items()))

    def backend(self, converter) -> handoff.Backend:
        """MediaTek's chain with the quantising Python step, runnable when mtk_converter and the compiler are present."""
        import importlib.util

        plain = handoff.mediatek_backend(converter)
        compile_ = shlex.split(converter.get("compile", ""))
        spec = handoff._export_spec(shlex.split(converter.get("convert", "")))
        python = ["{python}", "-c", PY_QUANT, "{onnx}", "{tflite}", "{input_names_json}", "{input_shapes}",
                  "{calibration}", "{precision}", spec]
        steps = [python] + ([compile_] if compile_ else [])
        modules = ("mtk_converter",)
        if not compile_:
            return handoff.Backend("mediatek-quant", steps, False, plain.reason, modules)
        missing = ([] if shutil.which(compile_[0]) else [f"{compile_[0]} (not on PATH)"]) + (
            [] if importlib.util.find_spec("mtk_converter") else ["the Python module mtk_converter (not importable)"])
        if missing:
            return handoff.Backend("mediatek-quant", steps, False,
                                   f"MediaTek's NeuroPilot SDK is needed: {' and '.join(missing)}", modules)
        return handoff.Backend("mediatek-quant", steps, True, modules=modules)

    def section(self) -> dict:
        return {"quant": {"scheme": self.scheme, "precision_proportion": self.proportion,
                          "precision_attested": set(self.proportion) <= ATTESTED, "per_output_channel": True,
                          "calibration": "calibration/<graph>.<partition>/*.npz",
                          **({"plan": self.plan} if self.plan else {})}}

