"""Real-size benchmark: mtkc check/compile vs onnxruntime's optimizer, onnxslim and I/O floors.

Generates random-weight Qwen2.5-0.5B / 1.5B-dimension exports (TorchScript op17 with KV cache, so
`mtkc compile` writes prefill + decode; external data) once into a cache folder, then measures
wall time, CPU time and peak RSS of each tool in its own child process, one at a time, prints a
table with ratios (check and compile against a weight copy timed just before each) and writes
JSON. See benchmarks/README.md.

    python benchmarks/bench.py                      # 0.5b and 1.5b, check/compile scaling at 2/24/48 layers
    python benchmarks/bench.py --quick              # before/after check of a change: 2 layers, mtkc + floors (< 3 min)
    python benchmarks/bench.py --sizes 0.5b --layers ""  --skip "ort optimizer"
    python benchmarks/bench.py --sizes "" --layers "" --inline 2   # inline vs external data only
    python benchmarks/bench.py --sizes "" --layers "" --nodes 780  # check on a 200k-node graph only
    python benchmarks/bench.py --readme             # README.md's performance tables from results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {"0.5b": {"heads": 14, "hidden": 896, "layers": 24}, "1.5b": {"heads": 12, "hidden": 1536, "layers": 28}}
COPY, GRAPH, START, CHECK, COMPILE, SLIM, ORT = (
    "weight copy (I/O floor)", "onnx load+save graph", "mtkc start+load (check's floor)", "mtkc check", "mtkc compile",
    "onnxslim", "ort optimizer")
VERIFY, GENERATE = "mtkc verify", "mtkc generate"
GENERATE_TOKENS = 32  # new tokens after a 64-token prompt: 1 prefill chunk, then decode steps
TARGETS = {  # (tool, what, limit) -- issue 21's targets, checked per size (skipped when a figure is missing)
    "compile wall <= 1.5x copy floor": (COMPILE, "floor", 1.5),
    "compile wall <= 0.5x onnxslim": (COMPILE, "slim", 0.5),
    "compile peak RSS <= 300 MB": (COMPILE, "rss", 300),
    "check wall <= 0.5x copy floor": (CHECK, "floor", 0.5),
    "check peak RSS <= 500 MB": (CHECK, "rss", 500),
    "verify wall <= 2x its onnxruntime runs": (VERIFY, "runs", 2.0),
    "generate peak RSS <= fp32 weights + 512 MB": (GENERATE, "rss_over_weights", 512),
}


# ----------------------------------------------------------------------------- measuring


def _tree_rss_mb(pid: int) -> float:
    """Resident MB of `pid` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21])  # pages
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(cmd: list[str], limit_mb: float, timeout: float = 1800, stdout=subprocess.DEVNULL) -> dict:
    """Run `cmd` as a child; wall seconds, CPU seconds (user + system, and user alone: with the
    children it waited for) and peak RSS (MB) of it and its descendants.

    Peak RSS is the larger of the kernel's ru_maxrss (largest single process) and the polled sum
    over the process tree. A tree above `limit_mb` is killed (reported, not measured): the machine
    is shared and some tools need many times the model size in RAM.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak, killed = [0.0], [""]
    stderr_lines: list[str] = []
    reader = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    reader.start()

    def poll() -> None:
        while proc.poll() is None:
            rss = _tree_rss_mb(proc.pid)
            peak[0] = max(peak[0], rss)
            over = rss > limit_mb
            late = time.perf_counter() - start > timeout
            if over or late:
                killed[0] = f"killed: RSS {rss:.0f} MB > limit {limit_mb:.0f} MB" if over else f"killed: timeout {timeout:.0f} s"
                os.killpg(proc.pid, 9)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    watcher.join()
    reader.join(timeout=5)
    code = os.waitstatus_to_exitcode(status)
    error = killed[0] or (stderr_lines[-1].strip() if code and stderr_lines else "")
    return {
        "cmd": " ".join(cmd),
        "exit": code,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "user_s": round(usage.ru_utime, 2),
        "peak_rss_mb": round(max(usage.ru_maxrss / 1024, peak[0]), 1),
        "error": error[:300],
    }


# ----------------------------------------------------------------------------- inputs


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the test-model factory lives there


def ensure_export(cache: Path, size: str, layers: int) -> Path:
    """Export once per (size, layers) into the cache (legacy17 + KV cache); returns model.onnx."""
    out = cache / f"qwen2-{size}-L{layers}-kv"
    model = out / "model.onnx"
    if model.exists():
        return model
    tmp = Path(f"{out}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    script = (
        f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import factory;"
        f"m = factory.build_model('qwen2', {size!r}, seed=0, layers={layers});"
        f"factory.export(m, {str(tmp)!r}, 'legacy17', cache=True)"
    )
    print(f"exporting {out.name} (once; minutes, several GB of RAM) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-c", script], check=True)
    subprocess.run([sys.executable, "-c", _EXTERNAL, str(tmp / "model.onnx")], check=True)
    os.replace(tmp, out)
    return model


# Under 2 GB the exporter keeps weights inline; move them out, one file per tensor as it does
# past 2 GB, so every size and layer count has the same layout.
_EXTERNAL = """
import onnx, os, sys
path = sys.argv[1]
if len(os.listdir(os.path.dirname(path))) == 1:
    m = onnx.load(path)
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=1024)
"""


def ensure_inline(cache: Path, layers: int) -> Path:
    """The same export with every weight inline in one .onnx (it must stay under 2 GB)."""
    external = ensure_export(cache, "0.5b", layers)
    out = cache / f"qwen2-0.5b-L{layers}-kv-inline"
    if not (out / "model.onnx").exists():
        tmp = Path(f"{out}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        subprocess.run([sys.executable, "-c", _INLINE, str(external), str(tmp / "model.onnx")], check=True)
        os.replace(tmp, out)
    return out / "model.onnx"


_INLINE = "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])"


def weight_files(model: Path) -> list[Path]:
    return sorted(p for p in model.parent.iterdir() if p.is_file() and p.name != model.name)


_COPY = """
import os, shutil, sys
dst = sys.argv[1]
for src in sys.argv[2:]:
    out = shutil.copy(src, dst)
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""
_GRAPH = "import onnx, sys; onnx.save(onnx.load(sys.argv[1], load_external_data=False), sys.argv[2])"
# what any `mtkc check` pays before its first pass: the interpreter, check's imports, the graph read and imported
_START = "import sys; import mtkc.pipeline.check; from mtkc.ir.model import load; load(sys.argv[1])"


_COUNTS = """
import json, sys
from mtkc.ir.counts import COUNTS
from mtkc.pipeline.compile import compile_model
compile_model(sys.argv[1], "8.0", sys.argv[2], {"seq_len": 128, "cache_len": 512, "no_convert": True})
print(json.dumps(dict(sorted(COUNTS.items()))))
"""


def compile_counts(model: Path, cache: Path) -> dict[str, int]:
    """Graph imports, pipeline runs, shape inferences and sessions of one compile (`mtkc.ir.counts`;
    empty for an mtkc without it)."""
    with tempfile.TemporaryDirectory(dir=cache, prefix=".bench-") as tmp:
        done = subprocess.run([sys.executable, "-c", _COUNTS, str(model), str(Path(tmp) / "out")],
                              capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {}


_RUNTIME = """
import json, sys
from mtkc.cli import main
from mtkc.ir.counts import SECONDS
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({k: round(v, 2) for k, v in SECONDS.items()}, f)
sys.exit(code)
"""


def run_runtime(model: Path, cache: Path, limit_mb: float) -> dict:
    """verify and generate on one compile of `model` (T=128, C=512): wall and peak RSS, and the seconds
    each spent in onnxruntime runs (`mtkc.ir.counts.SECONDS`, the bare forward passes it had to make)."""
    py, rows = sys.executable, {}
    weights_mb = sum(p.stat().st_size for p in weight_files(model)) / 2**20
    with tempfile.TemporaryDirectory(dir=cache, prefix=".bench-") as tmp:
        out, seconds = Path(tmp) / "out", Path(tmp) / "seconds.json"
        subprocess.run(tools(model, Path(tmp), "0.5b")[COMPILE][:-4] + ["-o", str(out), "--no-convert", "-q"], check=True)
        prompt = ",".join(str(1 + (7 * i) % 1000) for i in range(64))
        for name, args in ((VERIFY, ["verify", str(out)]),
                           (GENERATE, ["generate", str(out), "--prompt-ids", prompt, "--max-new-tokens",
                                       str(GENERATE_TOKENS), "--format", "json"])):
            print(f"[runtime] {name} ...", file=sys.stderr)
            row = measure([py, "-c", _RUNTIME, str(seconds), *args], limit_mb)
            row["onnxruntime_s"] = json.loads(seconds.read_text()) if seconds.exists() else {}
            row["weights_mb"] = round(weights_mb, 1)
            rows[name] = row
    return rows


def tools(model: Path, work: Path, size: str) -> dict[str, list[str]]:
    py, dims = sys.executable, SIZES[size]
    return {
        COPY: [py, "-c", _COPY, str(work / "copy")] + [str(p) for p in weight_files(model)],
        GRAPH: [py, "-c", _GRAPH, str(model), str(work / "graph.onnx")],
        START: [py, "-c", _START, str(model)],
        CHECK: [py, "-m", "mtkc", "check", str(model), "--sdk", "8.0", "--seq-len", "128", "--cache-len", "512",
                "--format", "json"],
        COMPILE: [py, "-m", "mtkc", "compile", str(model), "--sdk", "8.0", "--seq-len", "128", "--cache-len", "512",
                  "-o", str(work / "mtkc-out"), "--overwrite", "--no-convert"],
        SLIM: [py, "-m", "onnxslim", str(model), str(work / "slim.onnx"), "--save-as-external-data"],
        ORT: [py, "-m", "onnxruntime.transformers.optimizer", "--input", str(model), "--output", str(work / "ortopt.onnx"),
              "--model_type", "qwen3", "--num_heads", str(dims["heads"]), "--hidden_size", str(dims["hidden"]),
              "--use_external_data_format"],
    }


def run_size(cache: Path, size: str, skip: set[str], limit_mb: float, layers: int | None = None) -> dict:
    """Each tool's row; check and compile also carry `floor_s`, a weight copy timed just before them
    (the disk's speed swings within a run: 2.52 GB once took 2.7 s and 12.2 s in one run)."""
    model = ensure_export(cache, size, layers or SIZES[size]["layers"])
    rows = {}
    for name in tools(model, cache, size):
        if name in skip:
            continue
        floor = _run_tool(model, cache, size, COPY, limit_mb) if name in (CHECK, COMPILE) and COPY not in skip else None
        print(f"[{size}] {name} ...", file=sys.stderr)
        rows[name] = _run_tool(model, cache, size, name, limit_mb)
        if floor is not None and floor["exit"] == 0:
            rows[name]["floor_s"] = floor["wall_s"]
    if VERIFY not in skip:
        rows.update(run_runtime(model, cache, limit_mb))
    return {"model": str(model), "bytes": sum(p.stat().st_size for p in model.parent.iterdir()), "tools": rows,
            "compile_counts": compile_counts(model, cache) if COMPILE in rows else {}}


def _run_tool(model: Path, cache: Path, size: str, name: str, limit_mb: float) -> dict:
    """`measure` of tool `name` writing into a scratch folder of its own, on the input's disk."""
    with tempfile.TemporaryDirectory(dir=cache, prefix=".bench-") as tmp:
        work = Path(tmp)
        (work / "copy").mkdir()
        return measure(tools(model, work, size)[name], limit_mb)


def run_scaling(cache: Path, layer_counts: list[int], limit_mb: float) -> dict:
    """{layers: run_size's result}: the copy floor, check and compile at each layer count (0.5b dims)."""
    rows = {}
    for layers in layer_counts:
        result = run_size(cache, "0.5b", set(tools(Path("m"), Path("w"), "0.5b")) - {COPY, START, CHECK, COMPILE} | {VERIFY},
                          limit_mb, layers)
        result["targets"] = targets(result["tools"])
        rows[str(layers)] = result
    return rows


def run_many_nodes(cache: Path, layers: int, limit_mb: float) -> dict:
    """mtkc check on a tiny-dims export with `layers` layers (about 257 nodes each: 780 -> 200k nodes)."""
    import onnx

    model = ensure_export(cache, "tiny", layers)
    nodes = len(onnx.load(str(model), load_external_data=False).graph.node)
    print(f"[{nodes} nodes] {CHECK} ...", file=sys.stderr)
    row = measure(tools(model, cache, "0.5b")[CHECK], limit_mb)
    return {"model": str(model), "layers": layers, "nodes": nodes, CHECK: row,
            "target": {"value": row["wall_s"], "met": row["exit"] == 0 and row["wall_s"] <= 60}}


def run_inline(cache: Path, layers: int, limit_mb: float) -> dict:
    """mtkc check and compile of one export in its external-data and its inline form."""
    rows = {}
    for form, model in (("external", ensure_export(cache, "0.5b", layers)), ("inline", ensure_inline(cache, layers))):
        for tool in (CHECK, COMPILE):
            with tempfile.TemporaryDirectory(dir=cache, prefix=".bench-") as tmp:
                print(f"[inline L{layers}] {tool} ({form}) ...", file=sys.stderr)
                rows[f"{tool} ({form})"] = measure(tools(model, Path(tmp), "0.5b")[tool], limit_mb)
    return rows


# ----------------------------------------------------------------------------- reporting


def scaling_table(scaling: dict) -> str:
    lines = ["\n### mtkc check and compile scaling (0.5b dims)\n",
             "| layers | check s | its floor s | × floor | compile s | its floor s | × floor | compile CPU s "
             "| compile peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for layers, result in scaling.items():
        rows = result["tools"]
        lines.append(f"| {layers} | {_against_floor(rows, CHECK)} | {_against_floor(rows, COMPILE)} | "
                     f"{_number(rows[COMPILE].get('cpu_s'))} | {rows[COMPILE]['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def floor_of(rows: dict, name: str) -> float | None:
    """The copy floor `name` is held to: the one timed just before it, else the run's first."""
    return rows[name].get("floor_s") or rows.get(COPY, {}).get("wall_s")


def ratios(rows: dict) -> dict[str, dict]:
    slim = rows.get(SLIM, {})
    slim = slim.get("wall_s") if slim.get("exit") == 0 else None
    out = {}
    for name, r in rows.items():
        floor = floor_of(rows, name)
        out[name] = {"x_copy": round(r["wall_s"] / floor, 2) if floor else None,
                     "x_onnxslim": round(r["wall_s"] / slim, 2) if slim else None}
    return out


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _against_floor(rows: dict, name: str) -> str:
    """`wall s | floor s | × floor` cells of one tool."""
    ratio = ratios(rows)[name]["x_copy"]
    return f"{rows[name]['wall_s']:.1f} | {_number(floor_of(rows, name))} | {'-' if ratio is None else f'{ratio:.2f}'}"


def x_runs(row: dict) -> float | None:
    """A runtime row's wall time over the seconds it spent in onnxruntime runs (its floor)."""
    runs = (row.get("onnxruntime_s") or {}).get("onnxruntime runs")
    return round(row["wall_s"] / runs, 2) if runs else None


def targets(rows: dict) -> dict[str, dict]:
    out, rel = {}, ratios(rows)
    for label, (tool, what, limit) in TARGETS.items():
        if tool not in rows:
            continue
        row = rows[tool]
        value = {"floor": rel[tool]["x_copy"], "slim": rel[tool]["x_onnxslim"], "rss": row["peak_rss_mb"],
                 "runs": x_runs(row),
                 "rss_over_weights": round(row["peak_rss_mb"] - row.get("weights_mb", 0), 1)}[what]
        if value is None:
            continue
        out[label] = {"value": value, "met": value is not None and rows[tool]["exit"] == 0 and value <= limit}
    return out


def table(size: str, result: dict) -> str:
    rows, rel = result["tools"], ratios(result["tools"])
    lines = [f"\n### {size} ({result['bytes'] / 1e9:.2f} GB on disk)\n",
             "| tool | wall s | CPU s | its floor s | × copy floor | peak RSS MB | × onnxslim | exit |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        note = f" ({r['error']})" if r["error"] else ""
        if r.get("onnxruntime_s"):
            note += " (in onnxruntime: " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(r["onnxruntime_s"].items())) + ")"
        lines.append(f"| {name} | {r['wall_s']:.1f} | {_number(r.get('cpu_s'))} | {_number(floor_of(rows, name))} | "
                     f"{fmt(rel[name]['x_copy'])} | {r['peak_rss_mb']:.0f} | {fmt(rel[name]['x_onnxslim'])} | "
                     f"{r['exit']}{note} |")
    for label, t in result["targets"].items():
        lines.append(f"- target {label}: {t['value']} -> {'met' if t['met'] else 'NOT met'}")
    if result.get("compile_counts"):
        lines.append("- per compile: " + ", ".join(f"{v} {k}" for k, v in result["compile_counts"].items()))
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- bench.py --readme: begin -->", "<!-- bench.py --readme: end -->"


def readme_tables(results: dict) -> str:
    """The README's performance tables from a results.json: check/compile against the copy floor per
    export, then verify/generate against their onnxruntime runs, then the scaling and many-node lines."""
    rows = []
    for layers, result in results.get("scaling", {}).items():
        if int(layers) != SIZES["0.5b"]["layers"] or "0.5b" not in results.get("sizes", {}):
            rows.append((f"0.5B dims, {layers} layers", result))
    for size, result in results.get("sizes", {}).items():
        rows.append((f"{size.upper()}, {SIZES[size]['layers']} layers", result))
    rows.sort(key=lambda r: r[1]["bytes"])
    lines = [("| model | start+load s | `mtkc check` s | its floor s | × floor | `mtkc compile` s | its floor s "
              "| × floor | compile CPU s | compile peak RSS MB |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for label, result in rows:
        t = result["tools"]
        if not all(k in t for k in (COPY, START, CHECK, COMPILE)):
            continue
        lines.append(f"| {label} ({result['bytes'] / 1e9:.2f} GB) | {t[START]['wall_s']:.1f} | "
                     f"{_against_floor(t, CHECK)} | {_against_floor(t, COMPILE)} | {_number(t[COMPILE].get('cpu_s'))} | "
                     f"{t[COMPILE]['peak_rss_mb']:.0f} |")
    runtime = [(size, name, r) for size, result in results.get("sizes", {}).items()
               for name, r in result["tools"].items() if name in (VERIFY, GENERATE) and r.get("onnxruntime_s")]
    if runtime:
        lines += ["", ("| runtime (its onnxruntime runs are the floor) | wall s | in onnxruntime runs s | × runs "
                       "| peak RSS MB | fp32 weights MB |"), "|---|---|---|---|---|---|"]
        for size, name, r in runtime:
            runs, ratio = r["onnxruntime_s"].get("onnxruntime runs") or 0, x_runs(r)
            lines.append(f"| `{name}` {size.upper()} | {r['wall_s']:.1f} | {runs:.1f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}'} | "
                         f"{r['peak_rss_mb']:.0f} | {r.get('weights_mb', 0):.0f} |")
    notes = []
    counts = next((r["compile_counts"] for r in results.get("sizes", {}).values() if r.get("compile_counts")), None)
    if counts:
        notes.append("per compile: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if "scaling_48_over_24" in results:
        grown = results["scaling_48_over_24"]
        user = f" (user CPU {grown['user_cpu']}×)" if grown.get("user_cpu") else ""
        notes.append(f"compile at 48 vs 24 layers {grown['value']}×{user}")
    many = results.get("nodes")
    if many:
        notes.append(f"`mtkc check` of a {many['nodes']}-node graph ({many['layers']} tiny layers) "
                     f"{many[CHECK]['wall_s']:.0f} s, peak RSS {many[CHECK]['peak_rss_mb']:.0f} MB")
    if notes:
        lines += ["", "; ".join(notes) + f" (measured {results['machine']['time'][:10]}, "
                  f"load {results['machine']['loadavg_at_start'][0]}–{results['machine'].get('loadavg_at_end', ['?'])[0]})."]
    return "\n".join(lines)


def update_readme(readme: Path, results: dict) -> None:
    """Replace the text between README_BEGIN and README_END in `readme` with `readme_tables(results)`."""
    text = readme.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{readme}: no '{README_BEGIN}' ... '{README_END}' block")
    readme.write_text(text[:start + len(README_BEGIN)] + "\n" + readme_tables(results) + "\n" + text[end:])


def machine() -> dict:
    load = os.getloadavg()
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in load],
            "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated: 0.5b, 1.5b")
    parser.add_argument("--layers", default="2,24,48", help="layer counts for the check/compile scaling run (0.5b dims); '' skips")
    parser.add_argument("--quick", action="store_true", help="only the floors, check and compile on a 2-layer 0.5b-dims export")
    parser.add_argument("--inline", default="", help="layer count of a 0.5b-dims export measured inline vs external; '' skips")
    parser.add_argument("--nodes", default="", help="layer count of a tiny-dims export whose check is timed (780: about "
                        "200k nodes; target under a minute); '' skips")
    parser.add_argument("--cache", type=Path, default=HERE / "cache", help="exports and scratch space (gitignored)")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--skip", default="", help="comma-separated tool names to skip, of: "
                        f"{', '.join([*tools(Path('m'), Path('w'), '0.5b'), VERIFY])} ({VERIFY} skips {GENERATE} too)")
    parser.add_argument("--limit-gb", type=float, default=14.0, help="kill a tool whose process tree exceeds this RSS")
    parser.add_argument("--readme", type=Path, nargs="?", const=HERE.parent / "README.md", metavar="README",
                        help="measure nothing: rewrite the performance tables of README (default the project's) "
                             "from --out")
    args = parser.parse_args(argv)
    if args.readme:
        update_readme(args.readme, json.loads(args.out.read_text()))
        print(f"wrote {args.readme} from {args.out}", file=sys.stderr)
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.cache.mkdir(parents=True, exist_ok=True)
    limit = args.limit_gb * 1024
    results: dict = {"machine": machine(), "sizes": {}, "scaling": {}}
    if args.quick:
        args.sizes, args.layers, args.inline, args.nodes = "", "2", "", ""
        skip.add(VERIFY)
    for size in [s for s in args.sizes.split(",") if s]:
        result = run_size(args.cache, size, skip, limit)
        result["targets"] = targets(result["tools"])
        results["sizes"][size] = result
        print(table(size, result))
    if "0.5b" in results["sizes"] and "1.5b" in results["sizes"]:
        small, big = (results["sizes"][s]["tools"].get(COMPILE) for s in ("0.5b", "1.5b"))
        if small and big:
            growth = round(big["peak_rss_mb"] / small["peak_rss_mb"], 3)
            results["compile_rss_1.5b_over_0.5b"] = {"value": growth, "met": growth <= 1.10}
            print(f"- target compile peak RSS 1.5b within 10 % of 0.5b: {growth}x -> {'met' if growth <= 1.10 else 'NOT met'}")
    counts = [int(n) for n in args.layers.split(",") if n.strip()]
    if counts:
        results["scaling"] = run_scaling(args.cache, counts, limit)
        print(scaling_table(results["scaling"]))
        for layers, result in results["scaling"].items():
            print(table(f"0.5b dims, {layers} layers", result))
        s = results["scaling"]
        if "24" in s and "48" in s:
            ratio = round(s["48"]["tools"][COMPILE]["wall_s"] / s["24"]["tools"][COMPILE]["wall_s"], 2)
            user = round(s["48"]["tools"][COMPILE]["user_s"] / s["24"]["tools"][COMPILE]["user_s"], 2)
            results["scaling_48_over_24"] = {"value": ratio, "met": ratio <= 2.2, "user_cpu": user}
            print(f"- target 48 vs 24 layers <= 2.2x: {ratio}x -> {'met' if ratio <= 2.2 else 'NOT met'} "
                  f"(user CPU {user}x)")
    if args.nodes.strip():
        results["nodes"] = many = run_many_nodes(args.cache, int(args.nodes), limit)
        print(f"\n### mtkc check on {many['nodes']} nodes ({many['layers']} tiny layers): {many[CHECK]['wall_s']:.1f} s, "
              f"peak RSS {many[CHECK]['peak_rss_mb']:.0f} MB, exit {many[CHECK]['exit']} -> target under 60 s "
              f"{'met' if many['target']['met'] else 'NOT met'}")
    if args.inline.strip():
        layers = int(args.inline)
        results["inline"] = rows = run_inline(args.cache, layers, limit)
        print(f"\n### inline vs external data (0.5b dims, {layers} layers)\n\n| tool | wall s | peak RSS MB | exit |\n|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['exit']} |")
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
