"""The main job on a built-in example: a random-weight Qwen2.5-architecture model, end to end.

    python examples/qwen_tiny.py                       # tiny, legacy opset 17 with KV cache
    python examples/qwen_tiny.py --exporter dynamo --size 0.5b --out /tmp/qwen

Builds the model from a transformers config (no download), exports it to OUT/export/model.onnx,
runs `mtkc check` for NeuroPilot 6.0 and 9.0 with the sequence and cache lengths bound, then
`mtkc compile` for SDK 8.0 (static prefill + decode graphs over the KV cache; no converter is
installed here, so OUT/compiled/convert.sh holds the commands), `mtkc verify` against the export,
and `mtkc generate`, whose greedy tokens must equal transformers' `generate(do_sample=False)`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import factory
from mtkc import cli
from mtkc.runtime import generate

SDKS = ("6.0", "9.0")
COMPILE_SDK = "8.0"
MAX_NEW_TOKENS = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=factory.FAMILIES, default="qwen2")
    parser.add_argument("--size", choices=factory.SIZES, default="tiny")
    parser.add_argument("--layers", type=int, help="override the layer count")
    parser.add_argument("--exporter", choices=factory.EXPORTERS, default="legacy17")
    parser.add_argument("--no-cache", dest="cache", action="store_false", help="export without KV cache I/O")
    parser.add_argument("--seq-len", type=int, default=16, help="sequence length bound by check (default 16)")
    parser.add_argument("--cache-len", type=int, default=64, help="cache length bound by check (default 64)")
    parser.add_argument("--out", type=Path, help="output folder (default: a new temporary folder)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mtkc-qwen-"))

    start = time.perf_counter()
    model = factory.build_model(args.family, args.size, layers=args.layers)
    path = factory.export(model, out / "export", args.exporter, cache=args.cache)
    print(f"exported {args.family}-{args.size} ({args.exporter}, {'with' if args.cache else 'no'} KV cache) "
          f"to {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    shapes = ["--seq-len", str(args.seq_len)] + (["--cache-len", str(args.cache_len)] if args.cache else [])
    worst = 0
    for sdk in SDKS:
        print(f"\n== mtkc check --sdk {sdk}", flush=True)
        code = cli.main(["check", str(path), "--sdk", sdk, *shapes])
        sys.stdout.flush()
        worst = max(worst, code)
    if worst > 1:  # 1 = CPU fallback under --strict; anything else is a failure
        return worst

    compiled = out / "compiled"
    steps = [
        ["compile", str(path), "--sdk", COMPILE_SDK, *shapes, "-o", str(compiled), "--overwrite", "--no-convert"],
        ["verify", str(compiled), "--samples", "2"],
    ]
    for step in steps:
        print(f"\n== mtkc {' '.join(step[:1] + step[2:4])}", flush=True)
        code = cli.main(step)
        if code:
            return code
    if args.cache:
        prompt = [11, 22, 33, 44, 55]
        tokens = generate.generate(compiled, prompt, MAX_NEW_TOKENS)
        reference = factory.reference_generate(model, prompt, MAX_NEW_TOKENS)
        same = tokens == reference
        print(f"\n== mtkc generate --prompt-ids {','.join(map(str, prompt))}\n{tokens}")
        print(f"transformers generate(do_sample=False): {'identical' if same else reference}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
