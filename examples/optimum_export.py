"""Hugging Face Optimum's ONNX export (`optimum-cli export onnx`) in a side environment.

optimum-onnx pins transformers < 4.58, which conflicts with the transformers 5 the rest of mtkc's
tooling uses, so the export runs in a second venv: `python -m venv --system-site-packages` whose
`main-env.pth` also puts the calling environment's site-packages after its own (torch, onnx, numpy
... reused; torch is never reinstalled), plus `pip install --no-deps` of exactly `PINS`. The venv is
created once under `venvs/`, keyed by this file (the pins) and the Python version, behind a file
lock; a half-built one (no `ok` marker) is rebuilt. Any failure raises: never a silent skip.

The model is saved from the main environment (`save_pretrained`) and exported from that folder, so it
is exactly the `factory.build_model` weights; transformers 4.57 reads `rope_theta` at the top level of
config.json (5.x writes it inside `rope_parameters`), so it is copied there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PINS = ("transformers==4.57.6", "optimum==2.1.0", "optimum-onnx==0.1.0", "huggingface-hub==0.36.2",
        "tokenizers==0.22.2")


def environment(venvs) -> Path:
    """The side venv's python (created once under `venvs`, keyed by this file and the Python version)."""
    key = hashlib.sha256(sys.version.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    venvs = Path(venvs)
    venvs.mkdir(parents=True, exist_ok=True)
    root = venvs / f"optimum-{key}"
    python = root / "bin" / "python"
    with open(venvs / f"optimum-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "ok").exists():
            shutil.rmtree(root, ignore_errors=True)
            _run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], "python -m venv")
            site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], "python")
            main = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
            Path(site.strip(), "main-env.pth").write_text("".join(f"{p}\n" for p in sorted(main)))
            _run([str(python), "-m", "pip", "install", "-q", "--no-deps", *PINS], "pip install (optimum venv)")
            (root / "ok").write_text("\n".join(PINS) + "\n")
    return python


def export(model, out_dir: Path, cache: bool, venvs) -> None:
    """`optimum-cli export onnx --task text-generation[-with-past]` of `model` into `out_dir`."""
    python = environment(venvs)
    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir)
        config_path = Path(hf_dir) / "config.json"
        config = json.loads(config_path.read_text())
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2))
        task = "text-generation-with-past" if cache else "text-generation"
        _run([str(python), "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", hf_dir,
              "--task", task, str(out_dir)], "optimum-cli export onnx")


def _run(command: list[str], what: str) -> str:
    """stdout of `command`; a failure raises with its stderr's tail."""
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout
