"""Default pass pipelines: an ordered list of pass names per SDK.

Every entry is a pass name; a name whose pass is not registered is an error (exit 2), and
a pass whose `applies(ctx)` is false for the target is skipped and reported. So
one list serves every SDK unless one needs another order. Order rules are declared on the passes
(`requires`, `before`, `after`) and checked when the pipeline is resolved.
"""

from __future__ import annotations

DEFAULT = [
    "gqa",  # before kv-cache: the op's past/present become Concat(past, new, axis=2) like any export
    "mask-early",  # after gqa (its cache is then a Concat): a no-cache export's mask, while it still holds
    "kv-cache",  # first: finds/inserts the cache while shapes are still computed by Shape ops
    "bind-shapes",
    "contrib-ops",  # before fold: a constant operand's Transpose is folded (or kept, per fold's policy)
    "dynamic-quant",  # quantize_dynamic output -> MatMul on DequantizeLinear(int8 weight)
    "fold",
    "int4-weights",  # after fold: mtkc never folds the int8 codes into float weights
    "cleanup",
    "gelu",  # before opset17: Gelu has no opset-17 form
    "opset17",
    "rope",
    "rmsnorm",
    "swiglu",
    "attention",
    "mask",
    "embedding",
    "int64-to-int32",
    "rank4",
    "legalize",
    "kv-cache-io",  # last: the present outputs the runtime keeps, then one layer chunk
    "layer-chunks",
]

# SDK version -> pipeline, for targets that need another order than DEFAULT.
BY_SDK: dict[str, list[str]] = {}


def default_pipeline(sdk: str | None) -> list[str]:
    """The default pipeline for `sdk` (DEFAULT unless that SDK has its own)."""
    return list(BY_SDK.get(sdk or "", DEFAULT))
