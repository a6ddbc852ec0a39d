"""Option groups defined once and shared by check, compile, verify (Polygraphy-style).

Flags only parse; every value is validated by `mtkc.options.build`, the same way as the config
file's (`from_args`).
"""

from __future__ import annotations

import argparse
import json
import sys

from mtkc.errors import InputError
from mtkc.options import CACHE_IO, EMBEDDINGS, MAX_LEN, ROPE_MODES, Layer, Options, build
from mtkc.pipeline.config import load_config


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer messages on stderr")


def add_target(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--sdk", required=required, help="NeuroPilot SDK version (see `mtkc sdks`)")
    group.add_argument("--arch", help="MDLA arch; default: the SDK table's default")


def add_shapes(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shape binding")
    group.add_argument("--seq-len", type=int, metavar="T",
                       help=f"bind the sequence-length dim (1..{MAX_LEN}; compile's default for an unbound one: 128)")
    group.add_argument("--cache-len", type=int, metavar="C",
                       help="bind the past/cache-length dim (compile's default for an unbound one: 512)")
    group.add_argument("--batch", type=int, metavar="B", help="bind the batch dim (default 1)")
    group.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="bind one graph input's shape (repeatable)",
    )


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise InputError(f"--input-shape '{item}': expected NAME=D0,D1,... with integer dims") from None
    return shapes


def add_pipeline(parser: argparse.ArgumentParser) -> None:
    """Pass selection, plugins and the config file (see `mtkc passes`)."""
    group = parser.add_argument_group("passes")
    group.add_argument("--passes", metavar="A,B,...", help="run exactly these passes, in this order")
    group.add_argument("--skip-pass", action="append", default=[], metavar="PASS", help="drop a pass (repeatable)")
    group.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE.py|MODULE|NAME",
        help="load a plugin file or module, or enable an installed plugin pass (repeatable)",
    )
    group.add_argument("--config", metavar="FILE", help="mtkc.toml or pyproject.toml ([tool.mtkc]); default: ./mtkc.toml")


def add_llm(parser: argparse.ArgumentParser) -> None:
    """KV-cache and LLM-block options: they change the pipeline, so check takes them as compile does."""
    kv = parser.add_argument_group("KV cache (prefill/decode graphs)")
    kv.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="write prefill + decode graphs over a static cache (default: when the model has cache inputs)")
    kv.add_argument("--cache-io", metavar="|".join(CACHE_IO),
                    help="present_* outputs: new entries [1,Hkv,T,D] (default) or the slid cache")
    kv.add_argument("--chunks", type=int, metavar="N", help="split the decoder layers into N graphs per variant")
    llm = parser.add_argument_group("LLM blocks")
    llm.add_argument("--mask-value", type=float, metavar="V",
                     help="masked value of the additive attention_mask input (default -3e4; MediaTek's runtime uses -100)")
    llm.add_argument("--rope-mode", metavar="|".join(ROPE_MODES),
                     help="RoPE cos/sin: a constant table gathered by position_ids, or a pos_emb [1,2,T,D] input "
                          "(default: the one whose graph runs best on the SDK's NPU)")
    llm.add_argument("--embedding", metavar="|".join(EMBEDDINGS),
                     help="token embedding on the host: hidden_states input (default), or a CPU partition")
    llm.add_argument("--merge-gate-up", action="store_true", default=None,
                     help="merge the SwiGLU gate and up projections into one MatMul + Split")


def from_args(args: argparse.Namespace) -> Options:
    """Config (`--config`, or ./mtkc.toml / ./pyproject.toml) overridden by the flags given;
    both validated by `mtkc.options.build`."""
    def given(name: str):
        return getattr(args, name, None)  # a flag this subcommand lacks is not given

    cli = {
        "sdk": given("sdk"),
        "arch": given("arch"),
        "seq_len": given("seq_len"),
        "cache_len": given("cache_len"),
        "batch": given("batch"),
        "input_shapes": parse_input_shapes(given("input_shape") or []) or None,
        "passes": split_names(given("passes")),
        "skip_passes": given("skip_pass") or None,
        "plugins": given("plugin") or None,
        "verify_each": given("verify_each"),
        "kv_cache": given("kv_cache"),
        "cache_io": given("cache_io"),
        "chunks": given("chunks"),
        "mask_value": given("mask_value"),
        "rope_mode": given("rope_mode"),
        "embedding": given("embedding"),
        "merge_gate_up": given("merge_gate_up"),
        "min_partition_nodes": given("min_partition_nodes"),
        "force_cpu": given("force_cpu") or None,
        "force_npu": given("force_npu") or None,
        "converter_cmd": given("converter_cmd"),
        "no_convert": given("no_convert") or None,
        "converter_timeout": given("converter_timeout"),
        "overwrite": given("overwrite") or None,
    }
    config = load_config(given("config"))
    return build([layer for layer in (config, Layer(cli, "cli")) if layer is not None])


def with_sdk(options: Options) -> Options:
    """`check` and `compile` need an SDK, from --sdk or the config: one error line when neither gives it."""
    if not options.sdk:
        raise InputError("--sdk is required (or set sdk in mtkc.toml)")
    return options


def split_names(text: str | None) -> list[str] | None:
    """'a, b,c' -> ['a', 'b', 'c']; None stays None."""
    if text is None:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def print_json(data) -> None:
    """A command's `--format json` summary on stdout: indented, keys sorted (same input, same bytes)."""
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
