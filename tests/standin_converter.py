#!/usr/bin/env python3
"""A STAND-IN for MediaTek's converter, for tests and demos: it checks mtkc's hand-off contract
and fails the way a real converter does. It converts nothing.

    python tests/standin_converter.py --input P.onnx --output P.dla --arch mdla5.3 [--sdk 8.0]

Contract checked on the partition: opset <= 17; every graph input/output has a static shape;
no computed int64 tensor (int64 constants are tolerated: real converters cast them to int32);
every op is in the SDK table. Each violation prints one line `ERROR: ...` naming the op type and
node; the exit code is then 1. On success the output file is a small JSON record of what was
checked, marked as a stand-in (it is not a DLA).

Quantising hand-off (`mtkc convert OUT --quant`): `--calibration DIR --precision NAME` checks that
DIR holds calibration samples (.npz) whose keys are exactly the partition's input names, with the
input shapes, and that NAME is a MediaTek precision_proportion key; the record lists both.

Fault injection for tests: `--reject-op TYPE` / `--reject-node NAME` treat those as unsupported;
`--style terse` names only the op type, `--style opaque` names nothing (forces bisection).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import onnx

MAX_OPSET = 17


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--arch")
    p.add_argument("--sdk")
    p.add_argument("--reject-op", action="append", default=[])
    p.add_argument("--reject-node", action="append", default=[])
    p.add_argument("--style", choices=("named", "terse", "opaque"), default="named")
    p.add_argument("--calibration", help="folder of calibration samples (.npz, keys = input names)")
    p.add_argument("--precision", help="precision_proportion key, e.g. sym8W_sym16A")
    args = p.parse_args(argv)

    from mtkc.target.capability import available_sdks, load_table

    sdk = args.sdk or _sdk_for(args.arch, available_sdks(), load_table)
    table = load_table(sdk, args.arch or None)
    model = onnx.load(args.input, load_external_data=False)
    errors: list[str] = []

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset > MAX_OPSET:
        errors.append(f"ERROR: opset {opset} is newer than {MAX_OPSET}")
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if not value.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            errors.append(f"ERROR: tensor '{value.name}' has a dynamic shape")
    producers = {o: n for n in model.graph.node for o in n.output}
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            node = producers.get(value.name)
            where = f" (made by {node.op_type} node '{node.name}')" if node is not None else ""
            errors.append(f"ERROR: Int64 is not supported: tensor '{value.name}'{where}")
    for node in model.graph.node:
        rejected = node.op_type in args.reject_op or node.name in args.reject_node
        if rejected or not table.has_op(node.domain or "ai.onnx", node.op_type):
            errors.append(_unsupported(node, sdk, args.style))

    quant = _check_quant(model, args.calibration, args.precision, errors) if args.calibration or args.precision else None

    if errors:
        print("\n".join(errors), file=sys.stderr)
        print(f"standin-converter: {len(errors)} error(s); conversion failed", file=sys.stderr)
        return 1
    record = {
        "standin": "mtkc stand-in converter: contract checked, NOT a DLA",
        "input": args.input.rsplit("/", 1)[-1],
        "sdk": sdk,
        "arch": table.arch,
        "opset": opset,
        "nodes": len(model.graph.node),
        "ops": dict(sorted(Counter(n.op_type for n in model.graph.node).items())),
        "checks": ["opset<=17", "static-shapes", "no-int64-tensors", "ops-in-table"] + (["calibration-samples"] if quant else []),
        **({"quantization": quant} if quant else {}),
    }
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    print(f"standin-converter: ok, {len(model.graph.node)} nodes checked (no DLA written)")
    return 0


PRECISIONS = ("sym16W_sym16A", "sym8W_sym16A", "sym4W_sym16A", "sym8W_asym8A", "sym4W_asym8A")


def _check_quant(model: onnx.ModelProto, folder: str | None, precision: str | None, errors: list[str]) -> dict:
    """Calibration samples that feed this partition, and a known precision."""
    import glob

    import numpy as np

    if precision not in PRECISIONS:
        errors.append(f"ERROR: unknown precision '{precision}' (known: {', '.join(PRECISIONS)})")
    files = sorted(glob.glob(f"{folder}/*.npz")) if folder else []
    if not files:
        errors.append(f"ERROR: Calibration failed: insufficient data (no samples in '{folder}')")
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    for path in files:
        with np.load(path) as data:
            if sorted(data.files) != sorted(inputs):
                errors.append(f"ERROR: calibration sample '{path}' has inputs {sorted(data.files)}, expected {sorted(inputs)}")
                break
            bad = [k for k in data.files if list(data[k].shape) != inputs[k]]
            if bad:
                errors.append(f"ERROR: calibration sample '{path}' input '{bad[0]}' has shape {list(data[bad[0]].shape)}")
                break
    return {"precision": precision, "samples": len(files)}


def _unsupported(node: onnx.NodeProto, sdk: str, style: str) -> str:
    if style == "terse":
        return f"ERROR: Unsupported op type {node.op_type.upper()}"
    if style == "opaque":
        return "ERROR: NEURON_UNMAPPABLE (6): compilation failed"
    return f"ERROR: Unsupported operation {node.op_type} at node '{node.name}' (NeuroPilot {sdk})"


def _sdk_for(arch: str | None, sdks: list[str], load_table) -> str:
    """The newest SDK whose table knows `arch` (newest overall when no arch is given)."""
    for sdk in reversed(sdks):
        if not arch or arch in load_table(sdk).archs:
            return sdk
    raise SystemExit(f"standin-converter: no SDK table knows arch '{arch}'")


if __name__ == "__main__":
    sys.exit(main())
