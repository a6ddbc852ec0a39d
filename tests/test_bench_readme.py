"""benchmarks/bench.py --readme: the README's performance tables come from a results.json."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(wall, rss=100.0, **extra):
    return {"wall_s": wall, "peak_rss_mb": rss, "exit": 0, "error": "", **extra}


def _results(bench):
    tools = {bench.COPY: _row(4.0), bench.START: _row(1.0), bench.CHECK: _row(2.0, floor_s=5.0),
             bench.COMPILE: _row(6.0, 210, floor_s=3.0, cpu_s=4.5),
             bench.VERIFY: _row(30.0, 3000, onnxruntime_s={"onnxruntime runs": 20.0}, weights_mb=2404)}
    small = {bench.COPY: _row(1.0), bench.START: _row(0.5), bench.CHECK: _row(0.8), bench.COMPILE: _row(1.5, 110)}
    return {"machine": {"time": "2026-12-03T10:00:00Z", "loadavg_at_start": [1.0], "loadavg_at_end": [1.5]},
            "sizes": {"0.5b": {"bytes": 2.52e9, "tools": tools, "compile_counts": {"pipeline runs": 2}}},
            "scaling": {"2": {"bytes": 1.21e9, "tools": small}, "24": {"bytes": 2.52e9, "tools": tools}},
            "scaling_48_over_24": {"value": 1.96, "user_cpu": 1.8},
            "nodes": {"nodes": 197452, "layers": 780, bench.CHECK: _row(120.0, 2900)}}


def test_tables_give_each_export_once_smallest_first_with_ratios_to_its_floor(bench):
    """A tool timed with a copy just before it is held to that copy; without one, to the run's first."""
    text = bench.readme_tables(_results(bench))
    rows = [line for line in text.splitlines() if line.startswith("| 0.5B")]
    assert rows == ["| 0.5B dims, 2 layers (1.21 GB) | 0.5 | 0.8 | 1.0 | 0.80 | 1.5 | 1.0 | 1.50 | - | 110 |",
                    "| 0.5B, 24 layers (2.52 GB) | 1.0 | 2.0 | 5.0 | 0.40 | 6.0 | 3.0 | 2.00 | 4.5 | 210 |"]
    assert "| `mtkc verify` 0.5B | 30.0 | 20.0 | 1.50 | 3000 | 2404 |" in text
    assert "per compile: pipeline runs 2" in text and "48 vs 24 layers 1.96× (user CPU 1.8×)" in text
    assert "197452-node graph (780 tiny layers) 120 s" in text


def test_targets_hold_each_tool_to_the_floor_timed_before_it(bench):
    got = bench.targets(_results(bench)["sizes"]["0.5b"]["tools"])
    assert got["compile wall <= 1.5x copy floor"] == {"value": 2.0, "met": False}
    assert got["check wall <= 0.5x copy floor"] == {"value": 0.4, "met": True}


def test_measure_reports_the_cpu_seconds_of_the_command(bench):
    busy = bench.measure([sys.executable, "-c", "import time\nend = time.time() + 0.4\n"
                          "while time.time() < end: pass"], limit_mb=1000)  # the clock is read without a system call
    idle = bench.measure([sys.executable, "-c", "import time; time.sleep(0.3)"], limit_mb=1000)
    assert busy["exit"] == idle["exit"] == 0
    assert 0.3 <= busy["user_s"] <= busy["cpu_s"] <= busy["wall_s"] + 0.05
    assert idle["cpu_s"] < idle["wall_s"] - 0.2


def test_update_replaces_only_the_marked_block(bench, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.README_BEGIN}\nold table\n{bench.README_END}\nafter\n")
    bench.update_readme(readme, _results(bench))
    text = readme.read_text()
    assert text.startswith(f"before\n{bench.README_BEGIN}\n| model |") and text.endswith(f"{bench.README_END}\nafter\n")
    assert "old table" not in text
    bench.update_readme(readme, _results(bench))
    assert readme.read_text() == text  # same results, same bytes


def test_update_refuses_a_readme_without_the_block(bench, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no '<!-- bench.py --readme: begin -->'"):
        bench.update_readme(readme, _results(bench))
    assert readme.read_text() == "no markers\n"
