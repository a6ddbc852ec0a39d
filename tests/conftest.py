"""Shared fixtures: random-weight tiny models, their exports (cached on disk), and an in-process CLI runner.

Exports are cached under the pytest cache dir (side venvs, optimum's, in its `venvs/`), keyed by a
hash of the factory sources and the torch/transformers/onnxscript/onnxruntime versions, so repeated
sessions reuse them. Each variant is exported once: a per-variant file lock serialises concurrent test
processes, and the export is written to a temporary folder and renamed into place, so a reader never
sees half a model.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the test-model factory

SEED = 0


def _export_root(config) -> Path:
    import factory

    examples = Path(factory.__file__).parent
    source = hashlib.sha256(b"".join((examples / f).read_bytes() for f in ("factory.py", "optimum_export.py")))
    source = source.hexdigest()[:12]
    versions = "-".join(metadata.version(p) for p in ("torch", "transformers", "onnxscript", "onnxruntime"))
    key = f"{source}-{versions}".replace("+", "_")
    shared = os.environ.get("MTKC_EXPORT_CACHE")  # several checkouts may share one export cache
    root = (Path(shared) if shared else Path(config.cache.mkdir("mtkc-exports"))) / key
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_model():
    """`tiny_model(family="qwen2", attn="sdpa")` -> the seeded random-weight torch model (built once each)."""
    import factory

    models = {}

    def get(family: str = "qwen2", attn: str = "sdpa"):
        if (family, attn) not in models:
            models[family, attn] = factory.build_model(family, "tiny", seed=SEED, attn=attn)
        return models[family, attn]

    return get


@pytest.fixture(scope="session")
def exported(request, tiny_model):
    """`exported(family="qwen2", exporter="legacy17", cache=False, attn="sdpa")` -> Path to the tiny model.onnx."""
    import factory

    root = _export_root(request.config)

    def get(family: str = "qwen2", exporter: str = "legacy17", cache: bool = False, attn: str = "sdpa") -> Path:
        name = f"{family}-{exporter}-{'cache' if cache else 'nocache'}" + ("" if attn == "sdpa" else f"-{attn}")
        final = root / name
        if not (final / "model.onnx").exists():
            with open(root / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (final / "model.onnx").exists():
                    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
                    try:
                        # a copy: the session's model is every later export's and reference's, and a
                        # third-party exporter (optimum, the genai builder) is not held to leave it as it was
                        factory.export(copy.deepcopy(tiny_model(family, attn)), tmp, exporter, cache,
                                       venvs=root.parent / "venvs")
                        tmp.rename(final)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
        return final / "model.onnx"

    return get


def genai_generate(model_dir, prompt: list[int], n: int) -> list[int]:
    """onnxruntime-genai's greedy tokens on the export's own files (EOS does not stop it early)."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n, min_length=len(prompt) + n)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt):]]


@pytest.fixture(scope="session")
def reference_tokens(exported, tiny_model, tmp_path_factory):
    """`reference_tokens(family, exporter, cache, prompt, n)` -> the n greedy tokens the export is meant to
    give: onnxruntime-genai's `Generator` on (a copy of: og may write beside the model) its files for its
    exports, transformers' `generate` on the torch model otherwise. Each computed once per session."""
    import factory

    tokens = {}

    def get(family: str, exporter: str, cache: bool, prompt: list[int], n: int) -> list[int]:
        genai = exporter.startswith("genai-")
        key = (family, exporter if genai else "torch", tuple(prompt), n)
        if key not in tokens:
            if genai:
                local = tmp_path_factory.getbasetemp() / f"reference-genai-{family}-{exporter}"
                if not local.exists():
                    shutil.copytree(exported(family, exporter, cache=cache).parent, local)
                tokens[key] = genai_generate(local, list(prompt), n)
            else:
                tokens[key] = factory.reference_generate(tiny_model(family), list(prompt), n)
        return tokens[key]

    return get


@pytest.fixture(scope="session")
def run_cli():
    """`run_cli(*args, cwd=None)` -> (exit code, stdout, stderr) of `mtkc ARGS`, run in this process
    (`hostile_kit.run_cli`: logger and signal handlers reset per call). Tests of a real process
    (signals, exit on import, hash seeds) start one themselves."""
    from hostile_kit import run_cli as in_process

    def run(*args, cwd=None):
        result = in_process(args, cwd=cwd)
        return result.code, result.out, result.err

    return run
