"""The ONNX opset NPU partitions are written in (17), and which node forms exist there.

MediaTek's converters read ONNX up to opset 17. Newer forms of older ops (Split num_outputs,
Reduce* axes as an input, Pad axes, Cast saturate) are lowered by the `opset17` pass; an op added
after opset 17 (e.g. Gelu (20), RMSNormalization (23)) that no pass decomposed has no opset-17
form: the capability verdict sends it to the CPU (`no-opset17-form`), and NPU partitions are
written at opset 17.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

NPU_OPSET = 17
# ONNX-domain ops introduced after opset 17
NEW_AFTER_17 = frozenset({
    "Col2Im", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "CenterCropPad", "GroupNormalization", "Mish",
    "OptionalGetElement", "DeformConv", "AffineGrid", "Gelu", "ImageDecoder", "RegexFullMatch", "StringConcat",
    "StringSplit", "RMSNormalization", "RotaryEmbedding", "Attention", "TensorScatter", "Swish", "BitCast", "CumProd"})


def no_opset17_form(node: gs.Node) -> str | None:
    """Why `node` cannot be written at opset 17: an ONNX-domain op added later (None otherwise).

    Newer forms of older ops (Split num_outputs, Reduce* axes input, ...) are the `opset17`
    pass's to lower; they are not refused here."""
    if node.domain in (None, "", "ai.onnx") and node.op in NEW_AFTER_17:
        return f"{node.op} does not exist in opset {NPU_OPSET}"
    return None


def import_domains(domains, version: int = NPU_OPSET) -> list:
    """New opset ids with the ONNX domain at `version` (not edited in place: the parsed file's ids
    are shared by other graphs)."""
    return [onnx.helper.make_opsetid(o.domain, version if o.domain in ("", "ai.onnx") else o.version)
            for o in domains or []]
