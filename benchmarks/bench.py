"""Real-size benchmark: mtkc check/compile vs onnxruntime's optimizer, onnxslim and I/O floors.

Generates random-weight Qwen2.5-0.5B / 1.5B-dimension exports (TorchScript op17, external data)
once into a cache folder, then measures wall time and peak RSS of each tool in its own child
process (side by side, one run), prints a table with ratios and writes JSON.

    python benchmarks/bench.py --sizes 0.5b,1.5b --layers 12,24,48 --out benchmarks/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(cmd: list[str], cwd: Path | None = None, timeout: float = 1800) -> dict:
    """Run `cmd` as a child process; wall seconds and peak RSS (MB) of it and its descendants."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        proc.kill()
        raise
    wall = time.perf_counter() - start
    stderr = proc.stderr.read() if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    return {
        "cmd": " ".join(cmd),
        "exit": code,
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "error": stderr.strip().splitlines()[-1] if code and stderr.strip() else "",
    }


def ensure_export(cache: Path, size: str, layers: int | None) -> Path:
    """Export once per (size, layers) into the cache; returns the model.onnx path."""
    tag = f"qwen2-{size}" + (f"-L{layers}" if layers else "")
    out = cache / tag
    model = out / "model.onnx"
    if model.exists():
        return model
    script = (
        "import sys; from pathlib import Path; from mtkc import factory;"
        f"m = factory.build_model('qwen2', {size!r}, seed=0, layers={layers!r});"
        f"factory.export(m, Path({str(out) + '.tmp'!r}), 'legacy17', cache=False)"
    )
    shutil.rmtree(str(out) + ".tmp", ignore_errors=True)
    print(f"exporting {tag} (once) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-c", script], check=True)
    os.replace(str(out) + ".tmp", out)
    return model


def weight_files(model: Path) -> list[Path]:
    return [p for p in model.parent.iterdir() if p.is_file() and p.name != model.name]


def tools(model: Path, work: Path, size_args: dict) -> dict[str, list[str]]:
    py = sys.executable
    floor_roundtrip = (
        "import onnx,sys; m=onnx.load(sys.argv[1], load_external_data=False);"
        "onnx.save(m, sys.argv[2])"
    )
    copy = "import shutil,sys,os; [shutil.copy(p, sys.argv[1]) for p in sys.argv[2:]]; os.sync()"
    return {
        "weight copy (I/O floor)": [py, "-c", copy, str(work / "copy")] + [str(p) for p in weight_files(model)],
        "onnx load+save graph (floor)": [py, "-c", floor_roundtrip, str(model), str(work / "graph.onnx")],
        "mtkc check": [py, "-m", "mtkc", "check", str(model), "--sdk", "8.0", "--seq-len", "128", "--format", "json"],
        "mtkc compile": [
            py, "-m", "mtkc", "compile", str(model), "--sdk", "8.0", "--seq-len", "128", "--cache-len", "512",
            "-o", str(work / "mtkc-out"), "--overwrite",
        ],
        "onnxslim": [py, "-m", "onnxslim", str(model), str(work / "slim.onnx"), "--save-as-external-data"],
        "ort transformers optimizer": [
            py, "-m", "onnxruntime.transformers.optimizer", "--input", str(model), "--output",
            str(work / "ortopt.onnx"), "--model_type", "qwen3", "--num_heads", str(size_args["heads"]),
            "--hidden_size", str(size_args["hidden"]), "--use_external_data_format",
        ],
    }


SIZES = {"0.5b": {"heads": 14, "hidden": 896}, "1.5b": {"heads": 12, "hidden": 1536}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--layers", default="12,24,48", help="layer counts for the compile scaling run (0.5b dims)")
    parser.add_argument("--cache", type=Path, default=HERE / "cache")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--skip", default="", help="comma-separated tool names to skip (e.g. 'ort transformers optimizer')")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.cache.mkdir(parents=True, exist_ok=True)
    results: dict = {"sizes": {}, "scaling": {}}
    for size in [s for s in args.sizes.split(",") if s]:
        model = ensure_export(args.cache, size, None)
        rows = {}
        with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
            work = Path(tmp)
            (work / "copy").mkdir()
            for name, cmd in tools(model, work, SIZES[size]).items():
                if name in skip:
                    continue
                print(f"[{size}] {name} ...", file=sys.stderr)
                rows[name] = measure(cmd)
        results["sizes"][size] = rows
        print_table(size, rows)
    for layers in [int(n) for n in args.layers.split(",") if n]:
        model = ensure_export(args.cache, "0.5b", layers)
        with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
            cmd = tools(model, Path(tmp), SIZES["0.5b"])["mtkc compile"]
            print(f"[scaling] {layers} layers ...", file=sys.stderr)
            results["scaling"][str(layers)] = measure(cmd)
    if results["scaling"]:
        print("\nmtkc compile scaling (0.5b dims):")
        for layers, row in results["scaling"].items():
            print(f"  {layers:>3} layers: {row['wall_s']:7.2f} s  {row['peak_rss_mb']:8.1f} MB  exit {row['exit']}")
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def print_table(size: str, rows: dict) -> None:
    floor = rows.get("weight copy (I/O floor)", {}).get("wall_s")
    slim = rows.get("onnxslim", {}).get("wall_s")
    print(f"\n{size}: tool | wall s | peak RSS MB | × copy floor | × onnxslim | exit")
    for name, row in rows.items():
        ratio_floor = f"{row['wall_s'] / floor:.2f}" if floor else "-"
        ratio_slim = f"{row['wall_s'] / slim:.2f}" if slim else "-"
        print(f"  {name} | {row['wall_s']} | {row['peak_rss_mb']} | {ratio_floor} | {ratio_slim} | {row['exit']} {row['error']}")


if __name__ == "__main__":
    sys.exit(main())
