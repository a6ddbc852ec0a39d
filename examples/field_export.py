"""The field report's own export call, verbatim: the Hugging Face model itself (no wrapper, no
cache) through TorchScript at opset 14, with the report's names and dynamic axes.

    torch.onnx.export(model, (input_ids, attention_mask), path, input_names=[...],
                      output_names=[...], dynamic_axes=..., opset_version=14)

The model's own `forward` keeps its defaults (`use_cache` from the config, `logits_to_keep=0`),
so the graph carries whatever that tracing makes of them: the extra outputs of a cache built
inside `forward` and, with transformers 5, the `logits_to_keep` slice.
"""

from __future__ import annotations

import warnings
from pathlib import Path


def export_field_report(model, out_dir, seq: int = 8) -> Path:
    """Export `model` as the field report did; returns the path of `model.onnx`. The model's
    config is left as it was (the export turns `use_cache` off only while it traces)."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    use_cache, model.config.use_cache = model.config.use_cache, False  # a cache object is no traceable output
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer warnings from transformers internals; expected
            torch.onnx.export(
                model, (input_ids, attention_mask), str(path),
                input_names=["input_ids", "attention_mask"], output_names=["logits"],
                dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                              "logits": {0: "batch", 1: "sequence"}},
                opset_version=14, dynamo=False)
    finally:
        model.config.use_cache = use_cache
    return path


def export_half(model, out_dir, cache: bool = True, opset: int = 17) -> Path:
    """`model.half()` (in place) through the factory's TorchScript export (its wrapper, names and axes;
    float trace inputs in fp16): the fp16 export users bring. Returns the path of `model.onnx`."""
    import torch

    import factory

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    model = model.half()
    feeds = tuple(t.half() if t.is_floating_point() else t for t in factory.trace_inputs(model.config, cache))
    inputs, outputs = factory.io_names(model.config.num_hidden_layers, cache)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(factory.wrap(model, cache), feeds, str(path), dynamo=False, opset_version=opset,
                          input_names=inputs, output_names=outputs,
                          dynamic_axes=factory._dynamic_axes(model.config.num_hidden_layers, cache),
                          do_constant_folding=True)
    return path


def export_genai_fp16(model, out_dir) -> Path:
    """onnxruntime-genai's model builder in fp16 for CUDA (`-p fp16 -e cuda`; building needs no GPU):
    fp16 GroupQueryAttention, fp16 cache I/O. Returns the path of `model.onnx`."""
    import subprocess
    import sys
    import tempfile

    import factory

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as hf_dir:
        factory.save_model(model, hf_dir)
        factory._word_tokenizer(model.config.vocab_size).save_pretrained(hf_dir)
        proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf_dir, "-o", str(out_dir),
                               "-p", "fp16", "-e", "cuda"], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"onnxruntime_genai.models.builder failed: {proc.stderr.strip()[-2000:]}")
    return out_dir / "model.onnx"
