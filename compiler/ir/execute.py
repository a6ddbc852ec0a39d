"""Run a graph in onnxruntime without copying its weights, and build seeded inputs for it.

Every onnxruntime session mtkc opens on a user's graph comes from `open_session`: onnxruntime's
own log lines are off (they print raw node names and colour codes past mtkc's one-line, escaped
errors), creating it has a deadline and each `run` stops on Ctrl-C/SIGTERM and at its deadline
(`mtkc.interrupts`; a Loop of 10^12 iterations is an InputError naming the graph, not a hang).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from mtkc.errors import InputError
from mtkc.interrupts import Expired, deadline, interrupted
from mtkc.ir.counts import count, timed
from mtkc.ir.model import onnxruntime_view

EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"
LOAD_SECONDS = 600.0  # creating one session (a 7B graph takes about a minute)
RUN_SECONDS = 600.0  # one run (a 7B prefill takes seconds)
ort.set_default_logger_severity(4)  # also for sessions onnxruntime's own tools open (quantisation)


def session_options(optimize: bool = False) -> ort.SessionOptions:
    """Logging off; no graph optimisation, or basic (constant folding: the numbers are kept)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return options


class Bounded:
    """An onnxruntime session whose `run` ends on a signal and within `seconds`; otherwise the session."""

    def __init__(self, session: ort.InferenceSession, what: str, seconds: float):
        self.session, self.what, self.seconds = session, what, seconds

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    def run(self, names, feeds, run_options: ort.RunOptions | None = None):
        options = run_options or ort.RunOptions()
        stop = lambda: setattr(options, "terminate", True)  # noqa: E731 - checked between nodes, Loop iterations too
        try:
            with deadline(self.seconds, f"{self.what}: still running in onnxruntime after {self.seconds:g} s", stop), \
                    timed("onnxruntime runs"):
                return self.session.run(names, feeds, options)
        except Expired:
            raise InputError(f"{self.what}: still running in onnxruntime after {self.seconds:g} s (a Loop without "
                             "end, or a graph too large to run here); stopped") from None
        except Exception:
            if interrupted():
                raise KeyboardInterrupt from None
            raise


def open_session(model: str | bytes, options: ort.SessionOptions, what: str, load_seconds: float | None = None,
                 run_seconds: float | None = None) -> Bounded:
    """An onnxruntime CPU session (from a path or serialized bytes) under the deadlines above."""
    seconds = LOAD_SECONDS if load_seconds is None else load_seconds
    count("sessions")
    with deadline(seconds, f"{what}: onnxruntime did not finish loading it within {seconds:g} s; stopped"), \
            timed("onnxruntime loads"):
        sess = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return Bounded(sess, what, RUN_SECONDS if run_seconds is None else run_seconds)


def session(model: gs.Graph | onnx.ModelProto, root: Path | None = None) -> Bounded:
    """An ORT CPU session; external-data locations resolve against `root` (the model folder)."""
    proto = gs.export_onnx(model, do_type_check=False) if isinstance(model, gs.Graph) else model
    options = session_options()
    if root is not None:
        proto, root = onnxruntime_view(proto, root)
        options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(root))
    return open_session(proto.SerializeToString(), options, f"graph '{proto.graph.name}'")


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
