"""Random-weight Qwen2.5 / Llama-style models and their ONNX exports, for examples, tests, benchmarks.

No hub access: configs are built here. Weights are random but deterministic for a seed, with
initializer_range 0.3 and randomised RMSNorm weights and biases (the defaults, ones and zeros,
get deduplicated by exporters and would hide per-layer constants), so logits and greedy tokens vary.
torch / transformers / onnxscript are an optional extra (`mtkc[models]`): imported inside functions.

Exporters (`export(model, out_dir, exporter, cache)`), as they behave with torch 2.13 / transformers 5.24:

* ``legacy14`` / ``legacy17``: TorchScript ``torch.onnx.export(dynamo=False)`` at opset 14/17; one
  ``model.onnx``. Past 2 GB it switches to external data by itself, one file per tensor named after
  the initializer, and duplicates a tied lm_head as a transposed copy.
* ``dynamo``: ``torch.onnx.export(dynamo=True)``, default opset (20), ``optimize=True``;
  ``model.onnx`` + one ``model.onnx.data``. The cache attention_mask length gets an anonymous
  symbol (``sNN``); present lengths are ``past_sequence_length + sequence_length`` expressions.
* ``hf``: transformers' own ``transformers.exporters.OnnxExporter`` (dynamo + patches + onnxscript
  optimizer), no wrapper; ``model.onnx`` + ``model.onnx.data`` (+ its metadata/config json). Its I/O
  names are its own (``input.cache.layers.{i}.keys`` ... ``output.cache.layers.{i}.values``) and its
  dims are ``sNN`` auto-symbols; kept as exported, because that is what users feed mtkc.
* ``hf-ortfused``: ``hf`` with ``OnnxConfig(ort_fusions="cpu")``: com.microsoft
  SkipSimplifiedLayerNormalization and RotaryEmbedding, one SimplifiedLayerNormalization (default
  domain, an ORT contrib op), packed QKV and gate/up MatMul + Split; attention stays MatMul/Softmax.
* ``dynamo-ortfused``: ``dynamo``, then onnxscript's ``ort_fusions.optimize_for_ort``: com.microsoft
  MultiHeadAttention (per layer, on the already repeated K/V) and SkipSimplifiedLayerNormalization,
  one SimplifiedLayerNormalization; for tied Qwen2, FusedMatMul(transB) for the lm_head.
* ``hf-generate``: transformers' generation export (``decompose_for_generation`` -- what
  ``OnnxExporter.export_for_generation`` exports per stage -- with ``multi_token_decode=True``, so the
  query axis stays dynamic): with cache the ``decode`` stage (``input_ids, position_ids,
  input.cache.layers.{i}.keys/values`` -> ``logits, output.cache.layers.{i}.*``), without the
  ``prefill`` stage; **no attention_mask input**: the causal mask is built from shapes alone
  (Range/LessOrEqual, then Not/Cast/Mul additive and a Less(ReduceSum) row guard).
* ``dynamo-cacheobj``: ``torch.onnx.export(model, kwargs=..., dynamo=True)`` of the model itself with a
  ``DynamicCache`` argument (transformers' pytree registration, its auto dynamic shapes): inputs
  ``input_ids, attention_mask, position_ids, cache_0..`` (every cache dim symbolic, head dims
  included), outputs ``linear_N`` (logits) and ``cat_N`` (presents). Without cache: plain kwargs.
* ``genai-fp32`` / ``genai-int4``: onnxruntime-genai's model builder (``python -m
  onnxruntime_genai.models.builder -p fp32|int4 -e cpu``) on the saved model: opset 21+, packed-QKV
  com.microsoft GroupQueryAttention (``do_rotary=1``, cos/sin caches, seqlens_k and
  total_sequence_length from the 2-D mask, past/present consumed by the op; head dim
  ``kv_cache_dim``), (Skip)SimplifiedLayerNormalization (the saved config gets ``rope_parameters["type"]``
  beside ``rope_type``: the builder's long-rope reads transformers 4's key); int4: MatMulNBits (block 32) and
  GatherBlockQuantized, with the builder's CPU default ``accuracy_level=4`` (onnxruntime quantises
  MatMulNBits' activations to int8 at run time). ``genai-int4-acc1``: the same weights with
  ``--extra_options accuracy_level=1`` (fp32 activations: what an exact int4-weight reference
  computes). Always with cache I/O; ``genai_config.json`` beside the model (for ``og.Generator``).
  Needs the ``onnxruntime-genai`` package.
* ``optimum``: Hugging Face Optimum's ``optimum-cli export onnx --task text-generation[-with-past]``
  (TorchScript, opset 18; optimum's I/O names, as the wrapper's) in a side venv with transformers 4.57
  (``optimum_export.py``: optimum-onnx pins transformers < 4.58), created once under ``venvs``.
* ``ortopt``: a ``legacy17`` export run through ``onnxruntime.transformers.optimizer``
  (model_type ``qwen3``, the closest; it fuses RMSNorm into (Skip)SimplifiedLayerNormalization only;
  needs ~6x the weights in RAM for real sizes).

All exports match torch in onnxruntime (tiny: ~1e-5 abs at logits |10|; 0.5B dims: ~1e-4 at |50|)
except at fully padded query rows, which are undefined (legacy zeroes them, dynamo does not).
Exports are byte-identical across processes for the same seed.

Torch exporters get a flat-tensor wrapper (the cache case builds a ``DynamicCache`` inside
``forward``) with optimum I/O names: no cache ``input_ids, attention_mask -> logits``; with cache
``input_ids, attention_mask, position_ids, past_key_values.{i}.key/value -> logits,
present.{i}.key/value``. Dims: batch_size, sequence_length, past_sequence_length,
total_sequence_length. Trace shapes are deliberately unequal (batch 2, seq 7, past 5).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from pathlib import Path

FAMILIES = ("qwen2", "llama", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi35", "phi4mini", "llama3")
SIZES = ("tiny", "0.5b", "1.5b")
EXPORTERS = ("legacy14", "legacy17", "dynamo", "hf", "hf-ortfused", "dynamo-ortfused", "ortopt", "hf-generate",
             "dynamo-cacheobj", "genai-fp32", "genai-int4", "genai-int4-acc1", "optimum")
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 7, 5

_DIMS = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "1.5b": (1536, 28, 12, 2, 8960, 151936),
}


def model_config(family: str = "qwen2", size: str = "tiny", layers: int | None = None):
    """The transformers config: Qwen2.5 (q/k/v bias, tied) or Llama-style (no bias, untied), or one of
    the tiny-only families in `_TINY_FAMILIES` (their real structure, small dims and windows)."""
    from transformers import LlamaConfig, Qwen2Config

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    common = dict(hidden_act="silu", initializer_range=0.3, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family in _TINY_FAMILIES:
        if size != "tiny":
            raise ValueError(f"family {family!r} has only the tiny size")
        return _tiny_family_config(family, layers, common)
    if family == "qwen2":
        hidden, n_layers, heads, kv, inter, vocab = _DIMS.get(size, (64, 2, 4, 2, 128, 1000))
        config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers or n_layers,
                             num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                             vocab_size=vocab, tie_word_embeddings=True, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                             use_sliding_window=False, max_window_layers=layers or n_layers, **common)
    else:
        hidden, n_layers, heads, kv, inter, vocab = _DIMS.get(size, (128, 2, 8, 2, 256, 1000))  # head dim 16
        config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers or n_layers,
                             num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                             vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                             attention_bias=False, mlp_bias=False, **common)
    return config


_TINY_FAMILIES = ("qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi35", "phi4mini", "llama3")
SLIDING_WINDOW = 8  # the local layers' window (Mistral, Gemma 2/3): shorter than the tests' prompts


def _tiny_family_config(family: str, layers: int | None, common: dict):
    """Tiny configs with each family's structure: hidden 64, 4 heads of 16 (2 KV heads), vocab 1000.

    qwen3: per-head q/k RMSNorm, tied.  mistral: every layer sliding.  gemma2: GeGLU (tanh GELU),
    embedding x sqrt(hidden), (1 + w) RMSNorm, pre/post norms, attention and final-logit soft-capping,
    alternating sliding/global layers, query_pre_attn_scalar != head_dim.  gemma3: 5 local : 1 global
    layers, local RoPE base 1e4 / global 1e6, q/k norm.  phi3: fused qkv and gate_up (Phi-3-mini-4k,
    default RoPE).  phi35: phi3 with long-rope (short factors: positions stay below
    original_max_position_embeddings; TorchScript exports its factor switch through
    `_functional_longrope`).
    phi4mini: phi35 with partial rotary 0.75, tied.  llama3: llama3 rope scaling, tied.
    """
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen3Config

    dims = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                vocab_size=1000)
    n = layers or (6 if family == "gemma3" else 2)
    if family == "qwen3":
        return Qwen3Config(**dims, num_hidden_layers=n, tie_word_embeddings=True, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if family == "mistral":
        return MistralConfig(**dims, num_hidden_layers=n, tie_word_embeddings=False, rms_norm_eps=1e-5,
                             sliding_window=SLIDING_WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                             **common)
    gemma = dict(common, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":
        return Gemma2Config(**dims, num_hidden_layers=n, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
                            sliding_window=SLIDING_WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **gemma)
    if family == "gemma3":
        return Gemma3TextConfig(**dims, num_hidden_layers=n, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
                                sliding_window=SLIDING_WINDOW,
                                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                **gemma)
    if family == "phi3":
        return Phi3Config(**dims, num_hidden_layers=n, tie_word_embeddings=False, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **common)
    if family in ("phi35", "phi4mini"):
        rotary = 0.75 if family == "phi4mini" else 1.0
        half = int(16 * rotary) // 2
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": rotary,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
        return Phi3Config(**dims, num_hidden_layers=n, tie_word_embeddings=family == "phi4mini", rms_norm_eps=1e-5,
                          original_max_position_embeddings=256, rope_parameters=rope, partial_rotary_factor=rotary,
                          **common)
    return LlamaConfig(**dims, num_hidden_layers=n, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                       attention_bias=False, mlp_bias=False, **common)


def build_model(family: str = "qwen2", size: str = "tiny", seed: int = 0, layers: int | None = None,
                attn: str = "sdpa"):
    """A random-weight fp32 `Qwen2ForCausalLM` / `LlamaForCausalLM` in eval mode, deterministic per seed."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

    config = model_config(family, size, layers)
    if family == "gemma2":
        attn = "eager"  # transformers' sdpa has no soft-capping: Gemma 2 is eager-only
    cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}.get(family, AutoModelForCausalLM)
    torch.manual_seed(seed)
    build = cls._from_config if cls is not AutoModelForCausalLM else cls.from_config
    model = build(config, attn_implementation=attn, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        if family.startswith("gemma"):  # x sqrt(hidden) and tied: else the last token wins every logit
            model.model.embed_tokens.weight.mul_(config.hidden_size ** -0.5)
    return model.eval()


def save_model(model, out_dir) -> Path:
    """Save the torch model (config + safetensors) so a reference can be reloaded without rebuilding."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def load_model(model_dir, attn: str = "sdpa"):
    """Reload a model written by `save_model`: fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32).eval()


def reference_generate(model, prompt_ids, max_new_tokens: int = 32) -> list[int]:
    """Greedy tokens after `prompt_ids` (one sequence) from the torch model: the KV-cache reference."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def reference_logits(model, input_ids, attention_mask=None, past=None, position_ids=None):
    """Torch outputs for one feed in export order: logits, or [logits, *presents] when `past`
    (the flat key/value list) is given. Arrays in, numpy out; the mask defaults to all ones."""
    import torch

    ids = torch.as_tensor(input_ids)
    args = [ids, torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)]
    if past is not None:
        args += [torch.as_tensor(position_ids), *map(torch.as_tensor, past)]
    with torch.no_grad():
        out = wrap(model, past is not None)(*args)
    return [t.numpy() for t in out] if past is not None else out.numpy()


def trace_inputs(config, cache: bool, batch: int = TRACE_BATCH, seq: int = TRACE_SEQ, past: int = TRACE_PAST,
                 seed: int = 0):
    """(input_ids, attention_mask[, position_ids, *past]) tensors with a left-padded first row."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    total = past + seq if cache else seq
    input_ids = torch.randint(3, config.vocab_size, (batch, seq), generator=generator)
    mask = torch.ones(batch, total, dtype=torch.long)
    if batch > 1 and total > 2:
        mask[0, :2] = 0
    if not cache:
        return (input_ids, mask)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_shape = (batch, config.num_key_value_heads, past, head_dim)
    pasts = [torch.randn(kv_shape, generator=generator) for _ in range(2 * config.num_hidden_layers)]
    return (input_ids, mask, position_ids, *pasts)


def io_names(n_layers: int, cache: bool) -> tuple[list[str], list[str]]:
    """Optimum-style graph input and output names."""
    if not cache:
        return ["input_ids", "attention_mask"], ["logits"]
    kv = [f"{{}}.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    return (["input_ids", "attention_mask", "position_ids"] + [n.format("past_key_values") for n in kv],
            ["logits"] + [n.format("present") for n in kv])


@functools.cache
def _wrappers():
    """The flat-tensor wrapper classes (built on first use: their base class is torch's)."""
    import torch
    from transformers import DynamicCache

    class NoCache(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    class WithCache(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)], config=self.m.config)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
            presents = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    return NoCache, WithCache


def wrap(model, cache: bool):
    """The export wrapper: flat tensors in and out, optimum names in `io_names` order.

    It takes the model's train/eval mode: TorchScript's export runs in eval mode and then restores
    the wrapper's own mode, recursively, so a wrapper left in torch's default train mode switched
    the model to train mode."""
    return _wrappers()[1 if cache else 0](model).train(model.training)


def export(model, out_dir, exporter: str = "legacy17", cache: bool = False, attn: str | None = None,
           venvs=None) -> Path:
    """Export `model` into `out_dir` (created); returns the path of `model.onnx`.

    `attn` ("sdpa" | "eager") switches the model's attention implementation first; None keeps it.
    `venvs`: where side environments (optimum's) are created once; default ~/.cache/mtkc/venvs.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; expected one of {EXPORTERS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    previous = model.config._attn_implementation
    if attn is not None:
        model.set_attn_implementation(attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings from transformers internals; expected
        try:
            if exporter == "optimum":
                import optimum_export

                optimum_export.export(model, out_dir, cache, venvs or Path.home() / ".cache" / "mtkc" / "venvs")
            else:
                _export(model, out_dir, path, exporter, cache)
        finally:
            model.set_attn_implementation(previous)
    return path


def _export(model, out_dir: Path, path: Path, exporter: str, cache: bool) -> None:
    if exporter in ("legacy14", "legacy17"):
        _export_legacy(model, path, int(exporter[-2:]), cache)
    elif exporter == "dynamo":
        _export_dynamo(model, path, cache)
    elif exporter == "dynamo-ortfused":
        _export_dynamo_ortfused(model, path, cache)
    elif exporter in ("hf", "hf-ortfused"):
        _export_hf(model, out_dir, cache, ort_fusions="cpu" if exporter == "hf-ortfused" else None)
    elif exporter == "hf-generate":
        _export_hf_generate(model, out_dir, path, cache)
    elif exporter == "dynamo-cacheobj":
        _export_dynamo_cacheobj(model, path, cache)
    elif exporter.startswith("genai-"):
        precision, _, accuracy = exporter.removeprefix("genai-").partition("-acc")
        _export_genai(model, out_dir, precision, accuracy)
    else:
        _export_ortopt(model, path, cache)


def _dynamic_axes(n_layers: int, cache: bool) -> dict:
    inputs, outputs = io_names(n_layers, cache)
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"}, "logits": {0: "batch_size", 1: "sequence_length"}}
    if not cache:
        axes["attention_mask"] = {0: "batch_size", 1: "sequence_length"}
        return axes
    axes["attention_mask"] = {0: "batch_size", 1: "total_sequence_length"}
    axes["position_ids"] = {0: "batch_size", 1: "sequence_length"}
    for name in inputs[3:]:
        axes[name] = {0: "batch_size", 2: "past_sequence_length"}
    for name in outputs[1:]:
        axes[name] = {0: "batch_size", 2: "total_sequence_length"}
    return axes


def _export_legacy(model, path: Path, opset: int, cache: bool) -> None:
    import torch

    wrapper = wrap(model, cache)
    n_layers = model.config.num_hidden_layers
    inputs, outputs = io_names(n_layers, cache)
    with torch.no_grad(), _functional_longrope(model):
        torch.onnx.export(wrapper, trace_inputs(model.config, cache), str(path), dynamo=False,
                          opset_version=opset, input_names=inputs, output_names=outputs,
                          dynamic_axes=_dynamic_axes(n_layers, cache), do_constant_folding=True)


@contextlib.contextmanager
def _functional_longrope(model):
    """Long-rope (Phi-3.5, Phi-4-mini) without the in-place buffer update TorchScript cannot export.

    transformers picks the long or short inverse frequencies per call with
    `inv_freq.copy_(where(max(position_ids) + 1 > original_max, long, short))`: TorchScript fails
    with "Exporting the operator 'aten::copy' to ONNX opset version 17 is not supported". During the
    export the rotary embedding computes the same `where` and uses it directly (the switch stays in
    the graph; the buffer is left as it was), so the graph is the model's at every length."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", None) != "longrope":
        yield
        return
    plain = type(rotary).forward.__wrapped__  # the forward below transformers' frequency update
    limit = rotary.config.rope_parameters["original_max_position_embeddings"]
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, None, seq_len=limit + 1)
    short_inv, buffer = rotary.original_inv_freq, rotary.inv_freq

    def forward(x, position_ids):
        rotary._buffers["inv_freq"] = torch.where(position_ids.max() + 1 > limit, long_inv, short_inv)
        try:
            return plain(rotary, x, position_ids)
        finally:
            rotary._buffers["inv_freq"] = buffer

    rotary.forward = forward
    try:
        yield
    finally:
        del rotary.forward


def _export_dynamo(model, path: Path, cache: bool) -> None:
    """dynamic_axes cannot express the `*past` signature: dynamic_shapes keyed by parameter name."""
    import torch
    from torch.export import Dim

    batch, seq, past = Dim("batch_size"), Dim("sequence_length"), Dim("past_sequence_length")
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: Dim.DYNAMIC if cache else seq}}
    if cache:
        shapes["position_ids"] = {0: batch, 1: seq}
        shapes["past"] = tuple({0: batch, 2: past} for _ in range(2 * model.config.num_hidden_layers))
    inputs, outputs = io_names(model.config.num_hidden_layers, cache)
    with torch.no_grad():
        torch.onnx.export(wrap(model, cache), trace_inputs(model.config, cache), str(path), dynamo=True,
                          external_data=True, verbose=False, dynamic_shapes=shapes, input_names=inputs, output_names=outputs)


def _export_hf(model, out_dir: Path, cache: bool, ort_fusions: str | None) -> None:
    """transformers' exporter takes the model's own kwargs, a DynamicCache included."""
    import torch
    from transformers import DynamicCache
    from transformers.exporters import OnnxConfig, OnnxExporter

    feeds = trace_inputs(model.config, cache)
    sample = {"input_ids": feeds[0], "attention_mask": feeds[1]}
    if cache:
        past = feeds[3:]
        sample["position_ids"] = feeds[2]
        sample["cache"] = DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)], config=model.config)
    else:
        sample["use_cache"] = False
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):  # torch.onnx progress lines
        program = OnnxExporter().export(model, sample, config=OnnxConfig(dynamic=True, ort_fusions=ort_fusions))
    program.save_pretrained(out_dir)


def _export_hf_generate(model, out_dir: Path, path: Path, cache: bool) -> None:
    """One stage of transformers' generation export, saved as `model.onnx` (+ its `.data`)."""
    import torch
    from transformers.exporters import OnnxConfig, OnnxExporter
    from transformers.exporters.utils import decompose_for_generation

    ids = trace_inputs(model.config, False, batch=1)[0]
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 3}
    stage = "decode" if cache else "prefill"
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        submodel, inputs = decompose_for_generation(model, sample, multi_token_decode=True)[stage]
        program = OnnxExporter().export(submodel, inputs, config=OnnxConfig(dynamic=True))
    program.save_pretrained(out_dir)
    (out_dir / "model.onnx").replace(path)  # the external data keeps its file name


def _export_dynamo_cacheobj(model, path: Path, cache: bool) -> None:
    """The model itself, a DynamicCache among its kwargs (transformers registers the cache pytrees)."""
    import torch
    from transformers import DynamicCache
    from transformers.exporters.exporter_dynamo import get_auto_dynamic_shapes, register_cache_pytrees_for_model

    feeds = trace_inputs(model.config, cache)
    kwargs = {"input_ids": feeds[0], "attention_mask": feeds[1]}
    if cache:
        past = feeds[3:]
        kwargs["position_ids"] = feeds[2]
        kwargs["cache"] = DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)], config=model.config)
        register_cache_pytrees_for_model(model)
    shapes = get_auto_dynamic_shapes(kwargs)
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        torch.onnx.export(model, (), str(path), kwargs={**kwargs, "use_cache": cache}, dynamo=True,
                          external_data=True, dynamic_shapes={**shapes, "use_cache": None})


def _export_genai(model, out_dir: Path, precision: str, accuracy: str = "") -> None:
    """onnxruntime-genai's model builder on the saved model (a subprocess: it is a CLI);
    `accuracy`: MatMulNBits' accuracy_level (the builder's default when empty)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as hf_dir:
        save_model(model, hf_dir)
        _word_tokenizer(model.config.vocab_size).save_pretrained(hf_dir)  # the builder loads one
        _rope_type_key(Path(hf_dir) / "config.json")
        proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf_dir, "-o", str(out_dir),
                               "-p", precision, "-e", "cpu", *(["--extra_options", f"accuracy_level={accuracy}"] if accuracy else [])],
                              capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"onnxruntime_genai.models.builder failed: {proc.stderr.strip()[-2000:]}")


def _rope_type_key(config_path: Path) -> None:
    """The builder's Phi-3 long-rope reads `rope_parameters["type"]` (transformers 4's key; 5 writes
    `rope_type` only: KeyError 'type'): the same value under both keys."""
    import json

    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_type" in rope:
        rope.setdefault("type", rope["rope_type"])
        config_path.write_text(json.dumps(config, indent=2))


def _word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over tokens `t0..t{V-1}` (no hub: a model needs some tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0", bos_token="t1",
                                   eos_token="t2")


def _export_dynamo_ortfused(model, path: Path, cache: bool) -> None:
    """dynamo, then onnxscript's `ort_fusions.optimize_for_ort` (attention -> MultiHeadAttention)."""
    import onnx_ir
    from onnxscript.rewriter import ort_fusions

    raw = path.with_name("dynamo.onnx")
    _export_dynamo(model, raw, cache)
    fused, _ = ort_fusions.optimize_for_ort(onnx_ir.load(raw))
    onnx_ir.save(fused, path, external_data="model.onnx.data")
    raw.unlink()
    raw.with_name("dynamo.onnx.data").unlink()


def _export_ortopt(model, path: Path, cache: bool) -> None:
    """legacy17, then ORT's transformer optimizer in place."""
    import logging

    from onnxruntime.transformers import optimizer

    _export_legacy(model, path, 17, cache)
    external = any(p.name != path.name for p in path.parent.iterdir())
    logging.getLogger("onnxruntime.transformers").setLevel(logging.WARNING)
    optimized = optimizer.optimize_model(str(path), model_type="qwen3", num_heads=model.config.num_attention_heads,
                                         hidden_size=model.config.hidden_size)
    for old in path.parent.iterdir():
        old.unlink()
    optimized.save_model_to_file(str(path), use_external_data_format=external, all_tensors_to_one_file=True)
