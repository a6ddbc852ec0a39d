"""Train the reference model: a tiny Qwen2-architecture LM that has learnt something, without a hub.

    flock /work/bigrun.lock python examples/train_reference.py            # writes examples/reference/
    python examples/train_reference.py --out /tmp/ref --steps 50          # a quick smoke run

Text every Python install has: the standard library's .py sources (`sysconfig.get_paths()['stdlib']`),
files in sorted order, every tenth file held out. A byte-level BPE (vocab 2048, `tokenizers`) is
trained on the training files; a Qwen2ForCausalLM (4 layers, hidden 128, 4 heads / 2 KV heads, tied
embedding) is trained on random 96-token windows (batch 8) for a few minutes on CPU, seeds fixed. Written with
`save_pretrained` (config.json + model.safetensors) and the tokenizer's files, plus `heldout.txt`
(a slice of the held-out files, for `verify --quant --eval`) and `prompts.txt` (calibration lines
from the training files). `load()` reads it back without trust_remote_code.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "reference"
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 2048, 128, 4, 4, 2, 384
WINDOW, BATCH, SEED = 96, 8, 0
HELDOUT_CHARS, PROMPTS, PROMPT_CHARS = 40_000, 200, 160


def sources() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the stdlib's .py files in sorted order, every tenth held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return [t for k, t in enumerate(texts) if k % 10], [t for k, t in enumerate(texts) if k % 10 == 0]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|pad|>", "<|bos|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|endoftext|>")


def build(seed: int = SEED):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False,
                         max_window_layers=LAYERS, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def perplexity(model, ids, window: int = WINDOW) -> float:
    """exp(mean next-token loss) over consecutive `window`-token blocks of `ids`."""
    import torch

    blocks = ids[: len(ids) // window * window].view(-1, window)
    with torch.no_grad():
        loss = sum(float(model(b[None], labels=b[None]).loss) for b in blocks) / len(blocks)
    return math.exp(loss)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help=f"output folder (default {HERE})")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps (default 300)")
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    train, held = sources()
    tokenizer = train_tokenizer(train)
    eos = tokenizer.eos_token_id
    ids = torch.tensor([i for t in train for i in tokenizer(t)["input_ids"] + [eos]])
    heldout = "\n".join(held)[:HELDOUT_CHARS]
    held_ids = torch.tensor(tokenizer(heldout)["input_ids"])
    model = build()
    optimiser = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    generator = torch.Generator().manual_seed(SEED)
    start = time.time()
    model.train()
    for step in range(args.steps):
        offsets = torch.randint(0, len(ids) - WINDOW - 1, (BATCH,), generator=generator)
        batch = torch.stack([ids[o: o + WINDOW] for o in offsets.tolist()])
        loss = model(batch, labels=batch).loss
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {float(loss):.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
    print(f"{len(ids)} training tokens; held-out perplexity {perplexity(model, held_ids):.2f} "
          f"over {len(held_ids)} tokens", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "heldout.txt").write_text(heldout, encoding="utf-8")
    lines = [line.strip() for t in train for line in t.splitlines() if len(line.strip()) > 24]
    prompts = [lines[k * len(lines) // PROMPTS][:PROMPT_CHARS] for k in range(PROMPTS)]
    (args.out / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return 0


def load(folder: Path = HERE):
    """The trained model (fp32, eval, sdpa) and its tokenizer, from local files only."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32,
                                             local_files_only=True, trust_remote_code=False).eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def export(cache_root: Path, folder: Path = HERE) -> Path:
    """model.onnx of the trained model (factory's legacy17 TorchScript export with KV cache), made once
    under `cache_root` per content of the folder, factory.py and the torch/transformers versions; a file
    lock serialises concurrent sessions and the export is renamed into place whole."""
    import fcntl
    import hashlib
    import shutil
    import tempfile
    from importlib import metadata

    import factory

    digest = hashlib.sha256(Path(factory.__file__).read_bytes())
    for name in ("config.json", "model.safetensors"):
        digest.update((folder / name).read_bytes())
    versions = "-".join(metadata.version(p) for p in ("torch", "transformers", "onnxruntime"))
    name = f"reference-{digest.hexdigest()[:12]}-{versions}".replace("+", "_")
    final = Path(cache_root) / name
    Path(cache_root).mkdir(parents=True, exist_ok=True)
    if not (final / "model.onnx").exists():
        with open(Path(cache_root) / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (final / "model.onnx").exists():
                tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root))
                try:
                    factory.export(load(folder)[0], tmp, "legacy17", cache=True)
                    tmp.rename(final)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return final / "model.onnx"


if __name__ == "__main__":
    raise SystemExit(main())
