"""The field report's workflow, as the README walks through it: the report's own export call, then
check -> compile -> verify -> generate -> calibrate -> verify --quant -> convert.

    python examples/field_report.py                          # tiny Qwen2.5-config model, SDK 7.0
    python examples/field_report.py --converter none         # no converter: convert writes convert.sh
    python benchmarks/field_report.py --cache DIR            # the same at 0.5B dimensions (cached export)

Each step is the `mtkc` command line a user types, run as its own process and echoed (`$ mtkc ...`)
with its output. The export is `torch.onnx.export(model, (input_ids, attention_mask), ...,
opset_version=14)` of the transformers model itself (`field_export.py`): no cache, and a
`logits_to_keep` input, which compile removes with a note. `--kv-cache` makes the static
prefill/decode pair MediaTek's runtime runs; `generate`'s greedy tokens must equal transformers'
`generate(do_sample=False)`. The converter is tests/standin_converter.py (a stand-in that checks
mtkc's hand-off and converts nothing), or none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import factory
import field_export

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "tests" / "standin_converter.py"
PROMPT = [11, 22, 33, 44, 55]


def mtkc(*args, cwd: Path, ok=(0,)) -> tuple[int, str]:
    """Run `mtkc ARGS` in `cwd`, echo the command and its output; returns (exit code, stdout)."""
    print(f"\n$ mtkc {' '.join(map(str, args))}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mtkc", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stdout.write(proc.stderr)
    print(f"[exit {proc.returncode}, {time.perf_counter() - start:.1f} s]", flush=True)
    if proc.returncode not in ok:
        raise SystemExit(proc.returncode)
    return proc.returncode, proc.stdout


def prompts_file(path: Path, vocab: int, count: int) -> Path:
    """`count` seeded JSONL prompts of varied lengths (token ids: the model has no tokenizer)."""
    import numpy as np

    rng = np.random.default_rng(0)
    lines = [json.dumps({"ids": rng.integers(3, vocab, int(n)).tolist()}) for n in rng.integers(4, 40, count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=factory.SIZES, default="tiny")
    parser.add_argument("--exported", type=Path, help="a folder with export/model.onnx and torch/ (skip the export)")
    parser.add_argument("--out", type=Path, help="working folder (default: a new temporary folder)")
    parser.add_argument("--sdk", default="7.0")
    parser.add_argument("--shapes", default=None, help="compile's shape options (default: --seq-len 16 --cache-len 64 "
                        "for tiny, MediaTek's defaults T=128 C=512 otherwise)")
    parser.add_argument("--prompts", type=int, default=8, help="calibration prompts (default 8)")
    parser.add_argument("--quant", default="A16W8")
    parser.add_argument("--converter", choices=("standin", "none"), default="standin")
    args = parser.parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="mtkc-field-"))
    work.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    if args.exported:
        model_dir, path = args.exported / "torch", args.exported / "export" / "model.onnx"
        model = factory.load_model(model_dir)
    else:
        model = factory.build_model("qwen2", args.size)
        path = field_export.export_field_report(model, work / "export")
    print(f"exported qwen2-{args.size} with the field report's call to {path} "
          f"({time.perf_counter() - start:.1f} s)", flush=True)

    shapes = (args.shapes if args.shapes is not None else "--seq-len 16 --cache-len 64" if args.size == "tiny" else "").split()
    out = work / "out"
    mtkc("check", path, "--sdk", args.sdk, "--kv-cache", *shapes, cwd=work)
    mtkc("compile", path, "--sdk", args.sdk, "--kv-cache", *shapes, "-o", out, "--overwrite", "--no-convert", cwd=work)
    mtkc("verify", out, cwd=work)
    _, stdout = mtkc("generate", out, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 8,
                     "--format", "json", cwd=work)
    tokens, reference = json.loads(stdout)["tokens"], factory.reference_generate(model, PROMPT, 8)
    print(f"transformers generate(do_sample=False): {reference} -> {'identical' if tokens == reference else 'DIFFERENT'}")
    if tokens != reference:
        return 1
    prompts = prompts_file(work / "prompts.jsonl", model.config.vocab_size, args.prompts)
    mtkc("calibrate", out, "--prompts", prompts, "--decode-steps", 2, cwd=work)
    mtkc("verify", out, "--quant", args.quant, cwd=work, ok=(0, 1))  # 1: under the bar, layers named
    converter = []
    if args.converter == "standin":
        converter = ["--converter-cmd", f"{sys.executable} {STANDIN} --input {{input}} --output {{output}} --arch {{arch}} "
                     "--sdk {sdk} --calibration {calibration} --precision {precision}"]
    mtkc("convert", out, "--quant", args.quant, *converter, cwd=work)
    print(f"\nwalkthrough done in {time.perf_counter() - start:.1f} s; folder {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
