"""The scheme table on the trained reference model (examples/reference), as a user runs it.

    python examples/quant_table.py --work /tmp/qtable [--export-cache DIR]

export (train_reference.export) -> mtkc compile (--kv-cache, T=16, C=128) -> mtkc calibrate (the 200
prompts of examples/reference/prompts.txt, 4 decode steps) -> mtkc verify --quant for A16W8, A16W4,
A8W8, A16W4 --plan --target-cosine 0.99 and 0.9999, A8W8/A16W4 --smooth 0.5, each on 8 held-out prompts
(heldout.txt) with --eval heldout.txt (perplexity, float vs quantised). Prints each command and a
markdown table (cosine and top-1 of the prefill/decode logits teacher-forced, perplexity, greedy-token
agreement); writes WORK/quant_table.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_reference  # noqa: E402

RUNS = [("A16W8", []), ("A16W4", []), ("A8W8", []), ("A16W4", ["--plan", "--target-cosine", "0.99"]), ("A16W4", ["--plan", "--target-cosine", "0.9999"]),
        ("A8W8", ["--smooth", "0.5"]), ("A16W4", ["--smooth", "0.5"])]


def mtkc(*args, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mtkc", *map(str, args)]
    print("$ mtkc " + " ".join(map(str, args)), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise SystemExit(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1]}")
    return done


def row(name: str, data: dict) -> dict:
    logits = {o["graph"]: o for o in data["outputs"] if o["output"] == "logits"}
    return {"run": name, "units": data.get("units") or {},
            "cosine": {g: round(o["cosine"], 6) for g, o in logits.items()},
            "top1": {g: round(o["top1"], 3) for g, o in logits.items() if "top1" in o},
            "perplexity": data.get("perplexity"), "tokens": data["tokens"].get("agreement")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--export-cache", type=Path, default=Path(os.environ.get("MTKC_EXPORT_CACHE", HERE / "cache")))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    out, ref = args.work / "out", train_reference.HERE
    if not (out / "calibration").exists():
        model = train_reference.export(args.export_cache)
        mtkc("compile", model, "--sdk", "8.0", "--kv-cache", "--seq-len", 16, "--cache-len", 128, "-o", out,
             "--no-convert", "--overwrite")
        mtkc("calibrate", out, "--prompts", ref / "prompts.txt", "--tokenizer", ref, "--decode-steps", 4)
    held = [x.strip() for x in (ref / "heldout.txt").read_text().splitlines() if len(x.strip()) > 40]
    prompts = args.work / "heldout-prompts.txt"
    prompts.write_text("\n".join(held[:: len(held) // 8][:8]) + "\n")
    rows = []
    for scheme, extra in RUNS:
        done = mtkc("verify", out, "--quant", scheme, "--prompts", prompts, "--tokenizer", ref, "--eval", ref / "heldout.txt",
                    "--new-tokens", 8, "--format", "json", *extra, check=False)
        if done.returncode not in (0, 1):
            raise SystemExit(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1]}")
        rows.append(row(" ".join([scheme, *extra]), json.loads(done.stdout)))
    (args.work / "quant_table.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| run | raised | cosine prefill / decode | top-1 prefill / decode | perplexity float -> quantised | tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ppl = r["perplexity"] or {}
        print(f"| {r['run']} | {', '.join(f'{u} {s}' for u, s in r['units'].items()) or '-'} "
              f"| {r['cosine'].get('prefill', 0):.6f} / {r['cosine'].get('decode', 0):.6f} "
              f"| {r['top1'].get('prefill', 0):.3f} / {r['top1'].get('decode', 0):.3f} "
              f"| {ppl.get('float', 0):.3f} -> {ppl.get('quant', 0):.3f} | {r['tokens']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
