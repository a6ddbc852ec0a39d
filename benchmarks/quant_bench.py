"""Quantisation readiness at Qwen2.5-0.5B dimensions (random weights): calibrate, then simulate.

    python benchmarks/quant_bench.py [--prompts 200] [--decode-steps 1] [--layers 24]

Steps (each its own child process, wall and peak RSS measured by `bench.measure`):
  compile   the 0.5B-dimension export (legacy17 + KV cache; `bench.ensure_export`), T=128, C=512
  floor     the same prompts' forward passes (prefill calls, then K greedy decode calls) through the
            compiled whole graphs in plain onnxruntime sessions (default options), nothing stored
  calibrate N seeded prompts of 8..300 token ids, K greedy decode steps each; disk of OUT/calibration
  verify    --quant A16W8 / A16W4, without and with --keep-fp of the layers the first run names
Writes benchmarks/quant_results-L<layers>.json. Random weights are not trained weights: the cosines say how
the simulation behaves at this size, not how a real Qwen2.5 quantises.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench import HERE, ensure_export, machine, measure


def prompts_file(path: Path, count: int, vocab: int = 151936) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            n = rng.choice([rng.randint(8, 64), rng.randint(65, 200), rng.randint(201, 300)])
            f.write(json.dumps({"ids": [rng.randrange(3, vocab) for _ in range(n)]}) + "\n")
    return path


def disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def floor(out: Path, prompts: Path, decode_steps: int) -> dict:
    """The forward passes calibrate makes, bare: the reference runtime's host glue (mask, positions,
    cache) around plain onnxruntime sessions of the whole compiled graphs; prints its loop time."""
    import onnxruntime as ort

    from mtkc.runtime.generate import Generator

    generator = Generator(out)
    paths = {g["name"]: out / g["path"] for g in json.loads((out / "manifest.json").read_text())["graphs"]}
    for stage in generator.prefill + generator.decode:
        stage.session = None
    generator.sessions = None
    for stage in generator.prefill + generator.decode:
        stage.session = ort.InferenceSession(str(paths[stage.name]), providers=["CPUExecutionProvider"])
    ids = [json.loads(line)["ids"] for line in prompts.read_text().splitlines() if line.strip()]
    start = time.perf_counter()
    for prompt in ids:
        generator.generate(prompt, decode_steps + 1)
    return {"forward_s": round(time.perf_counter() - start, 1), "prompts": len(ids)}


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--floor-child"]:
        print(json.dumps(floor(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--decode-samples", type=int, default=1)
    p.add_argument("--cache", type=Path, default=HERE / "cache", help="exports (shared: bench.py --cache)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--calibration-samples", type=int, default=16, help="samples per partition the simulation calibrates on")
    p.add_argument("--eval-prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--schemes", default="A16W8,A16W4", help="schemes to simulate ('' = calibrate only)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per step")
    p.add_argument("--limit-gb", type=float, default=14)
    p.add_argument("--recompile", action="store_true", help="compile again when the work folder has OUT already")
    p.add_argument("--work", type=Path, default=HERE / "cache" / "quant")
    args = p.parse_args(argv)
    limit = args.limit_gb * 1024
    model = ensure_export(args.cache, "0.5b", args.layers)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / f"out-L{args.layers}"
    mtkc = [sys.executable, "-m", "mtkc"]
    rows = {}
    if args.recompile or not (out / "manifest.json").exists():
        rows["compile"] = measure(mtkc + ["compile", str(model), "--sdk", "8.0", "--seq-len", "128", "--cache-len", "512",
                                          "-o", str(out), "--no-convert", "--overwrite"], limit)
    prompts = prompts_file(args.work / "prompts.jsonl", args.prompts)
    floor_json = args.work / "floor.json"
    with open(floor_json, "w") as sink:
        rows["floor"] = measure([sys.executable, __file__, "--floor-child", str(out), str(prompts), str(args.decode_steps)],
                                limit, timeout=args.timeout, stdout=sink)
    rows["floor"].update(json.loads(floor_json.read_text() or "{}"))
    calibrate_json = args.work / "calibrate.json"
    with open(calibrate_json, "w") as sink:
        rows["calibrate"] = measure(mtkc + ["calibrate", str(out), "--prompts", str(prompts), "--decode-steps",
                                            str(args.decode_steps), "--decode-samples", str(args.decode_samples),
                                            "--format", "json"], limit, timeout=args.timeout, stdout=sink)
    entry = json.loads(calibrate_json.read_text() or "{}")
    rows["calibrate"].update(disk_bytes=disk(out / "calibration"), samples=entry.get("samples"),
                             forward_s=entry.get("seconds"))
    if rows["floor"].get("forward_s") and entry.get("seconds"):
        rows["calibrate"]["x_floor"] = round(entry["seconds"] / rows["floor"]["forward_s"], 2)
    results = {}
    for scheme in [x for x in args.schemes.split(",") if x]:
        for keep in (None, "named"):
            json_out = args.work / f"{scheme}-{keep or 'plain'}.json"
            cmd = mtkc + ["verify", str(out), "--quant", scheme, "--samples", str(args.eval_prompts), "--new-tokens",
                          str(args.new_tokens), "--calibration-samples", str(args.calibration_samples), "--format", "json"]
            if keep:
                named = results.get(f"{scheme} plain", {}).get("suggest")
                if not named:
                    continue
                cmd += ["--keep-fp", named.split()[-1]]
            with open(json_out, "w") as sink:
                row = measure(cmd, limit, timeout=args.timeout, stdout=sink)
            data = json.loads(json_out.read_text()) if json_out.stat().st_size else {}
            row.update({k: data.get(k) for k in ("suggest", "weak_layers", "keep_fp", "ok")})
            row["outputs"] = {f"{o['graph']}/{o['output']}": round(o["cosine"], 6) for o in data.get("outputs", [])
                              if o["output"] == "logits"}
            row["tokens"] = {k: data.get("tokens", {}).get(k) for k in ("agreement", "prefix", "prompts", "new_tokens")}
            row["layers"] = [round(entry["cosine"], 6) for entry in data.get("layers", [])]
            results[f"{scheme} {'plain' if not keep else 'keep-fp'}"] = row
    rows["verify"] = results
    report = {"note": "random weights (factory seed 0), not trained Qwen2.5 weights", "layers": args.layers,
              "calibration_samples": args.calibration_samples, "eval_prompts": args.eval_prompts,
              "new_tokens": args.new_tokens,
              "prompts": args.prompts, "decode_steps": args.decode_steps,
              "decode_samples": args.decode_samples, "rows": rows, "machine": machine()}
    (HERE / f"quant_results-L{args.layers}.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
