"""The field report's workflow at Qwen2.5-0.5B dimensions: its own export call, then the README's
walkthrough (`examples/field_report.py`), each step timed.

    flock /work/bigrun.lock python benchmarks/field_report.py --cache /work/bench-cache
    python benchmarks/field_report.py --cache DIR --steps compile,verify,generate

The export (the model itself through TorchScript at opset 14, no cache; `examples/field_export.py`)
is made once into CACHE/qwen2-0.5b-L24-fieldreport (with the torch model saved beside it, for the
transformers reference), like bench.py's exports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


def ensure_export(cache: Path, size: str = "0.5b") -> Path:
    """Export once (field report call + the saved torch model); returns the folder."""
    out = cache / f"qwen2-{size}-L24-fieldreport"
    if (out / "export" / "model.onnx").exists():
        return out
    tmp = Path(f"{out}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    script = (
        f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import factory, field_export;"
        f"m = factory.build_model('qwen2', {size!r}, seed=0);"
        f"factory.save_model(m, {str(tmp / 'torch')!r});"
        f"field_export.export_field_report(m, {str(tmp / 'export')!r})"
    )
    print(f"exporting {out.name} (once; minutes, several GB of RAM) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-c", script], check=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--size", default="0.5b", choices=("0.5b", "1.5b"))
    parser.add_argument("--export-only", action="store_true")
    args, rest = parser.parse_known_args(argv)
    exported = ensure_export(args.cache, args.size)
    if args.export_only:
        return 0
    cmd = [sys.executable, str(EXAMPLES / "field_report.py"), "--size", args.size, "--exported", str(exported),
           "--out", str(args.cache / f"fieldreport-{args.size}-run"), *rest]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
