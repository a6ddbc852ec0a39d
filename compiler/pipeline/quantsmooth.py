"""`--smooth ALPHA`: SmoothQuant's activation-to-weight scale migration, an exact float rewrite.

    X = norm(h) * g          (g: the norm's constant per-channel weight [K])
    Y_i = X @ W_i            (every user of X a MatMul with a constant weight [K, N_i])
  ->
    s_k = max|X_k|^α / max_i,n |W_i[k, n]|^(1-α)      (X's per-channel range over calibration samples)
    g' = g / s,  W_i' = diag(s) W_i                    so X' @ W_i' = X @ W_i in exact arithmetic

Per-tensor activation ranges then see X' with its outlier channels scaled down, the per-channel
weights absorb them. Rewritten copies get new initializer names (a weight shared elsewhere is
left as it was). Applied to the float copy of an NPU partition before calibration; the caller may
say how the model runs, how a weight is read and how a new one is stored (`quantsim`: over the
mapped weights, the rewritten ones written to a file), one weight at a time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from mtkc.pipeline import quantstream

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


def in_memory(model: onnx.ModelProto):
    """An onnxruntime session of a model holding its weights."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def channel_absmax(proto: onnx.ModelProto, tensors: list[str], feeds, run_on=in_memory) -> dict[str, np.ndarray]:
    """Per-last-axis max |value| of `tensors` over the feeds (the model run by `run_on`'s session)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in tensors)
    session = run_on(probe)
    result: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, value in zip(tensors, session.run(tensors, feed)):
            m = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            result[name] = np.maximum(result[name], m) if name in result else m
    return result


def smooth(proto: onnx.ModelProto, feeds, alpha: float, run_on=in_memory, load=numpy_helper.to_array,
           make=numpy_helper.from_array) -> int:
    """Rewrite `proto` in place; returns the number of norm -> MatMul sites scaled. `run_on(model)`:
    a session; `load(tensor)`: its values; `make(array, name)`: the TensorProto of a new weight."""
    found = sites(proto.graph)
    if not found:
        return 0
    ranges = channel_absmax(proto, [node.output[0] for node, _, _ in found], list(feeds), run_on)
    consts = {t.name: t for t in proto.graph.initializer}
    for node, index, readers in found:
        weights = [load(consts[u.input[1]]) for u in readers]
        w_max = np.max([quantstream.channel_absmax(w, 0) for w in weights], axis=0).astype(np.float64)
        x_max = ranges[node.output[0]].astype(np.float64)
        s = np.where((x_max > 0) & (w_max > 0), x_max ** alpha / np.maximum(w_max, 1e-12) ** (1 - alpha), 1.0)
        s = np.clip(s, 1e-4, 1e4)
        gain = np.asarray(load(consts[node.input[index]])).astype(np.float64)
        node.input[index] = _add(proto, f"{node.input[index]}.smooth", (gain / s.reshape(gain.shape)).astype(np.float32), make)
        for u, w in zip(readers, weights):
            u.input[1] = _add(proto, f"{u.input[1]}.smooth", scaled_rows(w, s), make)
    used = {name for node in proto.graph.node for name in node.input}
    kept = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    return len(found)


def scaled_rows(w: np.ndarray, s: np.ndarray, rows: int = 1024) -> np.ndarray:
    """diag(s) @ w in float64, rounded to float32, a block of rows at a time (w may be a mapping)."""
    result = np.empty(w.shape, np.float32)
    for i in range(0, w.shape[0], rows):
        result[i:i + rows] = w[i:i + rows].astype(np.float64) * s[i:i + rows, None]
    return result


def _add(proto: onnx.ModelProto, name: str, value: np.ndarray, make) -> str:
    taken = {t.name for t in proto.graph.initializer}  # a few sites per layer: cheap
    base, k = name, 1
    while name in taken:
        name, k = f"{base}{k}", k + 1
    proto.graph.initializer.append(make(value, name))
    return name
