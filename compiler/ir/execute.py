"""Run a graph in onnxruntime without copying its weights, and build seeded inputs for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from mtkc.ir.counts import count
from mtkc.ir.model import onnxruntime_view

EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def session(model: gs.Graph | onnx.ModelProto, root: Path | None = None) -> ort.InferenceSession:
    """An ORT CPU session; external-data locations resolve against `root` (the model folder)."""
    proto = gs.export_onnx(model, do_type_check=False) if isinstance(model, gs.Graph) else model
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its own error lines would bypass mtkc's one-line errors
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if root is not None:
        proto, root = onnxruntime_view(proto, root)
        options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(root))
    count("sessions")
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(model: gs.Graph | onnx.ModelProto, feeds: dict[str, np.ndarray], root: Path | None = None) -> dict[str, np.ndarray]:
    """Run once; returns outputs by name."""
    sess = session(model, root)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def seeded_inputs(graph: gs.Graph, seed: int = 0, dims: dict[str, int] | None = None, int_high: int = 100) -> dict[str, np.ndarray]:
    """Deterministic inputs for every graph input; symbolic dims resolve from `dims` or to 1.

    Integer inputs are drawn from [0, int_high) (token ids must stay inside the vocabulary);
    inputs named like an attention mask get all-ones (int) or zeros (additive float).
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for tensor in graph.inputs:
        shape = tuple(d if isinstance(d, int) and d >= 0 else (dims or {}).get(str(d), 1) for d in tensor.shape)
        dtype = np.dtype(tensor.dtype)
        is_mask = "mask" in tensor.name
        if np.issubdtype(dtype, np.integer):
            feeds[tensor.name] = np.ones(shape, dtype) if is_mask else rng.integers(0, int_high, shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[tensor.name] = np.ones(shape, dtype)
        else:
            feeds[tensor.name] = np.zeros(shape, dtype) if is_mask else rng.standard_normal(shape).astype(dtype)
    return feeds
