"""Quantisation readiness at Qwen2.5-0.5B dimensions (random weights): calibrate, simulate, convert.

    python benchmarks/quant_bench.py --cache /work/bench-cache [--prompts 200] [--decode-steps 8]
        [--layers 24] [--lock /work/bigrun.lock] [--plan]

Steps (each its own child process, wall and peak RSS measured by `bench.measure`; with `--lock`,
each one alone holding that flock, its wait not timed):
  compile   the 0.5B-dimension export (legacy17 + KV cache; `bench.ensure_export`), T=128, C=512
  floor     the same prompts' forward passes (prefill calls, then K greedy decode calls) through the
            compiled whole graphs in plain onnxruntime sessions (default options), nothing stored
  calibrate N seeded prompts of 8..300 token ids (the field report's mix), K greedy decode steps
            each; disk of OUT/calibration
  verify    --quant of each of --schemes with --min-cosine 0 (random weights are under any bar, and
            under it verify would add the per-unit sensitivity: 25 more simulations, not what is timed
            here); with --plan also A16W4 --plan (quant-plan.json, the sensitivity included)
  convert   --quant A16W8 with the stand-in converter (tests/standin_converter.py)
Writes benchmarks/quant_results-L<layers>.json after every step. Random weights are not trained
weights: the cosines say how the simulation behaves at this size, not how a real Qwen2.5 quantises.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
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


@contextlib.contextmanager
def held(lock: str | None):
    """The real-size lock held for one step (`flock` semantics; the wait is not in the step's time)."""
    if not lock:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--floor-child"]:
        print(json.dumps(floor(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--decode-samples", type=int, default=1)
    p.add_argument("--cache", type=Path, default=HERE / "cache", help="exports (shared: bench.py --cache)")
    p.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b"], help="model dimensions (examples/factory.py)")
    p.add_argument("--layers", type=int, default=None, help="default: the size's own (24 / 28)")
    p.add_argument("--calibration-samples", type=int, default=16, help="samples per partition the simulation calibrates on")
    p.add_argument("--eval-prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--schemes", default="A16W8,A16W4", help="schemes to simulate ('' = calibrate only)")
    p.add_argument("--plan", action="store_true", help="also verify --quant A16W4 --plan")
    p.add_argument("--steps", default="floor,calibrate,verify,convert", help="steps to run (compile runs when OUT is missing)")
    p.add_argument("--lock", help="run each step under `flock LOCK` (a shared machine's real-size lock)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per step")
    p.add_argument("--limit-gb", type=float, default=14)
    p.add_argument("--recompile", action="store_true", help="compile again when the work folder has OUT already")
    p.add_argument("--work", type=Path, default=HERE / "cache" / "quant")
    args = p.parse_args(argv)
    limit = args.limit_gb * 1024
    args.layers = args.layers or {"0.5b": 24, "1.5b": 28}[args.size]
    model = ensure_export(args.cache, args.size, args.layers)
    tag = f"L{args.layers}" if args.size == "0.5b" else f"{args.size}-L{args.layers}"
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / f"out-{tag}"
    mtkc = [sys.executable, "-m", "mtkc"]

    def timed(cmd: list[str], **kwargs) -> dict:
        with held(args.lock):
            return measure(cmd, limit, **kwargs)

    steps = set(args.steps.split(","))
    path = HERE / f"quant_results-{tag}.json"
    settings = {"calibration_samples": args.calibration_samples, "eval_prompts": args.eval_prompts,
                "new_tokens": args.new_tokens, "prompts": args.prompts, "decode_steps": args.decode_steps,
                "decode_samples": args.decode_samples, "machine": machine()}
    rows: dict = {}

    def save() -> None:
        """Merge this run's steps (each with the settings it ran with) into the results file."""
        report = json.loads(path.read_text()) if path.exists() else {}
        report.update(note="random weights (factory seed 0), not trained Qwen2.5 weights", layers=args.layers, size=args.size)
        for key, value in rows.items():
            if key == "verify":
                report.setdefault("rows", {}).setdefault("verify", {}).update(
                    {name: {**row, "settings": settings} for name, row in value.items()})
            else:
                report.setdefault("rows", {})[key] = {**value, "settings": settings}
        path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")

    if args.recompile or not (out / "manifest.json").exists():
        rows["compile"] = timed(mtkc + ["compile", str(model), "--sdk", "8.0", "--seq-len", "128", "--cache-len", "512",
                                        "-o", str(out), "--no-convert", "--overwrite"])
        save()
    prompts = prompts_file(args.work / "prompts.jsonl", args.prompts)
    if "floor" in steps:
        floor_json = args.work / "floor.json"
        with open(floor_json, "w") as sink:
            rows["floor"] = timed([sys.executable, __file__, "--floor-child", str(out), str(prompts), str(args.decode_steps)],
                                  timeout=args.timeout, stdout=sink)
        rows["floor"].update(json.loads(floor_json.read_text() or "{}"))
        save()
    if "calibrate" in steps:
        calibrate_json = args.work / "calibrate.json"
        with open(calibrate_json, "w") as sink:
            rows["calibrate"] = timed(mtkc + ["calibrate", str(out), "--prompts", str(prompts), "--decode-steps",
                                              str(args.decode_steps), "--decode-samples", str(args.decode_samples),
                                              "--format", "json"], timeout=args.timeout, stdout=sink)
        entry = json.loads(calibrate_json.read_text() or "{}")
        rows["calibrate"].update(disk_bytes=disk(out / "calibration"), samples=entry.get("samples"),
                                 seconds=entry.get("seconds"))
        if rows.get("floor", {}).get("forward_s") and entry.get("seconds"):
            rows["calibrate"]["x_floor"] = round(entry["seconds"] / rows["floor"]["forward_s"], 2)
        save()
    if "verify" in steps:
        runs = [(scheme, []) for scheme in args.schemes.split(",") if scheme] + ([("A16W4", ["--plan"])] if args.plan else [])
        results = rows.setdefault("verify", {})
        for scheme, extra in runs:
            name = f"{scheme} {' '.join(extra) or 'plain'}"
            json_out = args.work / f"{scheme}-{'plan' if extra else 'plain'}.json"
            cmd = mtkc + ["verify", str(out), "--quant", scheme, "--samples", str(args.eval_prompts), "--new-tokens",
                          str(args.new_tokens), "--calibration-samples", str(args.calibration_samples), "--format", "json",
                          *(extra or ["--min-cosine", "0"])]
            with open(json_out, "w") as sink:
                row = timed(cmd, timeout=args.timeout, stdout=sink)
            data = json.loads(json_out.read_text()) if json_out.stat().st_size else {}
            row.update({k: data.get(k) for k in ("suggest", "weak_layers", "keep_fp", "ok", "units", "mask_value")})
            row["outputs"] = {f"{o['graph']}/{o['output']}": round(o["cosine"], 6) for o in data.get("outputs", [])
                              if o["output"] == "logits"}
            row["tokens"] = {k: data.get("tokens", {}).get(k) for k in ("agreement", "prefix", "prompts", "new_tokens")}
            row["layers"] = [round(entry["cosine"], 6) for entry in data.get("layers", [])]
            results[name] = row
            save()
    if "convert" in steps:
        standin = HERE.parent / "tests" / "standin_converter.py"
        rows["convert"] = timed(mtkc + ["convert", str(out), "--quant", "A16W8", "--converter-cmd",
                                        f"{sys.executable} {standin} --input {{input}} --output {{output}} --arch {{arch}} "
                                        "--sdk {sdk} --calibration {calibration} --precision {precision}"],
                                timeout=args.timeout)
        save()
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
