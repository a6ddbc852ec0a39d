"""The main job on a built-in example: a random-weight Qwen2.5-architecture model, exported, then checked.

    python examples/qwen_tiny.py                       # tiny, legacy opset 17 with KV cache
    python examples/qwen_tiny.py --exporter dynamo --size 0.5b --out /tmp/qwen

Builds the model from a transformers config (no download), exports it to OUT/export/model.onnx,
then runs `mtkc check` for NeuroPilot 6.0 and 9.0 with the sequence and cache lengths bound.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from mtkc import cli, factory

SDKS = ("6.0", "9.0")


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
    return worst


if __name__ == "__main__":
    sys.exit(main())
