"""The ONNX opset NPU partitions are written in (17), and which node forms exist there.

MediaTek's converters read ONNX up to opset 17. Newer forms of older ops (Split num_outputs,
Reduce* axes as an input, Pad axes, Cast saturate) are lowered by the `opset17` pass; an op added
after opset 17 (e.g. Gelu (20), RMSNormalization (23)) that no pass decomposed has no opset-17
form: the capability verdict sends it to the CPU (`no-opset17-form`), and NPU partitions are
written at opset 17.
"""

from __future__ import annotations

import onnx
import onnx.numpy_helper
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


# Reduce ops whose axes became an input in opset 18 (an attribute up to 17)
AXES_INPUT_FROM_18 = frozenset({"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                                "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})


def axes_to_attributes(proto: onnx.ModelProto) -> None:
    """A model written at opset <= 17: every AXES_INPUT_FROM_18 node whose axes input is an
    initializer gets them as the attribute (in place). A pass that emitted the 18+ form for a
    graph kept at 18+ (a node without an opset-17 form) has its NPU partitions written at 17."""
    version = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None or version > NPU_OPSET:
        return
    inits = {t.name: t for t in proto.graph.initializer}
    detached = set()
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in AXES_INPUT_FROM_18 and len(node.input) == 2 \
                and node.input[1] in inits:
            axes = onnx.numpy_helper.to_array(inits[node.input[1]]).reshape(-1).tolist()
            detached.add(node.input[1])
            del node.input[1:]
            node.attribute.append(onnx.helper.make_attribute("axes", [int(a) for a in axes]))
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    kept = [t for t in proto.graph.initializer if t.name in used or t.name not in detached]
    if len(kept) != len(proto.graph.initializer):
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)


def import_domains(domains, version: int = NPU_OPSET) -> list:
    """New opset ids with the ONNX domain at `version` (not edited in place: the parsed file's ids
    are shared by other graphs)."""
    return [onnx.helper.make_opsetid(o.domain, version if o.domain in ("", "ai.onnx") else o.version)
            for o in domains or []]
