"""`--smooth ALPHA`: SmoothQuant's activation-to-weight scale migration, an exact float rewrite.

    X = norm(h) * g          (g: the norm's constant per-channel weight [K])
    Y_i = X @ W_i            (every user of X a MatMul with a constant weight [K, N_i])
  ->
    s_k = max|X_k|^α / max_i,n |W_i[k, n]|^(1-α)      (X's per-channel range over calibration samples)
    g' = g / s,  W_i' = diag(s) W_i                    so X' @ W_i' = X @ W_i in exact arithmetic

Per-tensor activation ranges then see X' with its outlier channels scaled down, the per-channel
weights absorb them. Rewritten copies get new initializer names (a weight shared elsewhere is
left as it was). Applied to the float copy of an NPU partition before calibration.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

NORMS = ("SimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization")
MAX_SAMPLES = 32  # calibration samples read for the per-channel activation ranges


def sites(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, int, list[onnx.NodeProto]]]:
    """(scale node, index of its constant per-channel input, the MatMuls reading its output)."""
    consts = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = []
    for node in graph.node:
        if node.op_type == "Mul":
            index = next((k for k, name in enumerate(node.input) if name in consts and len(consts[name].dims) >= 1
                          and int(np.prod(consts[name].dims)) == consts[name].dims[-1] > 1), None)
        elif node.op_type in NORMS and len(node.input) > 1 and node.input[1] in consts:
            index = 1
        else:
            continue
        if index is None or not node.output or node.output[0] in outputs:
            continue
        width = consts[node.input[index]].dims[-1]
        readers = users.get(node.output[0], [])
        if readers and all(u.op_type == "MatMul" and u.input[0] == node.output[0] and len(u.input) > 1
                           and u.input[1] in consts and len(consts[u.input[1]].dims) == 2
                           and consts[u.input[1]].dims[0] == width for u in readers):
            found.append((node, index, readers))
    return found


def channel_absmax(proto: onnx.ModelProto, tensors: list[str], feeds) -> dict[str, np.ndarray]:
    """Per-last-axis max |value| of `tensors` over the feeds (the model run in onnxruntime)."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in tensors)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    result: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, value in zip(tensors, session.run(tensors, feed)):
            m = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            result[name] = np.maximum(result[name], m) if name in result else m
    return result


def smooth(proto: onnx.ModelProto, feeds, alpha: float) -> int:
    """Rewrite `proto` in place (weights loaded); returns the number of norm -> MatMul sites scaled."""
    found = sites(proto.graph)
    if not found:
        return 0
    ranges = channel_absmax(proto, [node.output[0] for node, _, _ in found], list(feeds))
    consts = {t.name: t for t in proto.graph.initializer}
    for node, index, readers in found:
        weights = [numpy_helper.to_array(consts[u.input[1]]) for u in readers]
        w_max = np.max([np.abs(w).max(1) for w in weights], axis=0).astype(np.float64)
        x_max = ranges[node.output[0]].astype(np.float64)
        s = np.where((x_max > 0) & (w_max > 0), x_max ** alpha / np.maximum(w_max, 1e-12) ** (1 - alpha), 1.0)
        s = np.clip(s, 1e-4, 1e4)
        gain = numpy_helper.to_array(consts[node.input[index]]).astype(np.float64)
        node.input[index] = _add(proto, f"{node.input[index]}.smooth", (gain / s.reshape(gain.shape)).astype(np.float32))
        for u, w in zip(readers, weights):
            u.input[1] = _add(proto, f"{u.input[1]}.smooth", (w.astype(np.float64) * s[:, None]).astype(np.float32))
    used = {name for node in proto.graph.node for name in node.input}
    kept = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    return len(found)


def _add(proto: onnx.ModelProto, name: str, value: np.ndarray) -> str:
    taken = {t.name for t in proto.graph.initializer}  # a few sites per layer: cheap
    base, k = name, 1
    while name in taken:
        name, k = f"{base}{k}", k + 1
    proto.graph.initializer.append(numpy_helper.from_array(value, name))
    return name
