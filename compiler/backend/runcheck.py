"""Before OUT is published: every graph written (whole graphs and partitions) loads and runs once
in onnxruntime on seeded inputs.

A compile that exits 0 must leave graphs that run. A graph onnxruntime refuses (a model-local
function left out, an op or dtype the opset cannot express, an output nothing produces) is an
InputError naming the file and what onnxruntime said (which names the node), and nothing is
published. Dynamic dims run as 1; integer inputs are zeros (a valid token id and position),
float inputs seeded normals, masks zeros. A graph with an input over `MAX_FEED_ELEMENTS`, or whose
tensors (static after compile: the sizes its shapes announce) add up to more than `MAX_RUN_BYTES`
(attention at `--seq-len 4096 --cache-len 12288`: GBs for a 1 MB model), is only loaded. Loading
and running have deadlines (`LOAD_SECONDS`, `RUN_SECONDS`: a Loop of 10^12 iterations is an
InputError) and stop on Ctrl-C/SIGTERM (`mtkc.ir.execute`). Folders whose weights exceed `MAX_RUN_WEIGHT_BYTES` are only loaded (onnxruntime
resolves every graph, its types and kernels over one read-only mapping of the weights, which it
does not touch); running them would page in every weight (measured at 0.5B dims: 2.4 GB peak and
+25 s on a 16 s compile): logged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from onnx import helper

from mtkc.ir.outdir import check_graph_file
from mtkc.errors import InputError
from mtkc.runtime.sessions import Sessions

log = logging.getLogger("mtkc")

MAX_RUN_WEIGHT_BYTES = 256 << 20
MAX_FEED_ELEMENTS = 1 << 26  # per input; an LLM's largest (a KV-cache slab) is ~1e6
MAX_RUN_BYTES = 512 << 20  # every tensor of a graph at once (an upper bound of a run's peak)
LOAD_SECONDS = 120.0
RUN_SECONDS = 60.0  # the run check's graphs are small (see above): a tiny model runs in milliseconds
SEED = 0
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
              "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def check_runs(out: Path, manifest: dict) -> None:
    """Load and run every graph and partition the manifest names (paths relative to `out`)."""
    weights = sum(p.stat().st_size for p in Path(out).glob("*.bin"))
    run = weights <= MAX_RUN_WEIGHT_BYTES
    if not run:
        log.info("mtkc: %.1f GB of weights: the written graphs are loaded in onnxruntime, not test-run "
                 "(up to %.2f GB)", weights / 1e9, MAX_RUN_WEIGHT_BYTES / 1e9)
    sessions = Sessions(out, optimize=False, seconds=(LOAD_SECONDS, RUN_SECONDS))  # one mapping of weights.bin
    for graph in manifest.get("graphs", []):
        files = [(graph["path"], f"graph '{graph['name']}'")]
        files += [(part["path"], f"partition {graph['name']}/{part['id']}") for part in graph.get("partitions", [])]
        for relative, what in files:
            _run(Path(out), relative, what, sessions, run)
            sessions.release(Path(out) / relative)  # one session at a time: compile's peak is its build's


def _run(out: Path, relative: str, what: str, sessions: Sessions, run: bool) -> None:
    try:
        sess = sessions.get(out / relative)
        if not run:
            return
        rng = np.random.default_rng(SEED)
        shapes = [[d if isinstance(d, int) and d >= 0 else 1 for d in x.shape] for x in sess.get_inputs()]
        if any(np.prod(s, dtype=np.float64) > MAX_FEED_ELEMENTS for s in shapes):
            log.info("mtkc: %s: an input is too large to test-run; it was only loaded", relative)
            return
        size = tensor_bytes(check_graph_file(out / relative))
        if size > MAX_RUN_BYTES:
            log.info("mtkc: %s: its tensors hold %.1f GB; it was only loaded, not test-run (up to %.2f GB)",
                     relative, size / 1e9, MAX_RUN_BYTES / 1e9)
            return
        feeds = {x.name: _feed(x, rng) for x in sess.get_inputs()}
        sess.run(None, feeds)
    except InputError:
        raise
    except Exception as exc:  # onnxruntime's errors name the node
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise InputError(f"{relative}: the {what} written does not run in onnxruntime: {text[:400]}; "
                         "nothing was written") from None


def tensor_bytes(proto) -> float:
    """Bytes of every tensor the graph's shapes announce (inputs, outputs, value_info; a dim not
    known counts 1), each once."""
    seen, total = set(), 0.0
    g = proto.graph
    for info in (*g.input, *g.output, *g.value_info):
        t = info.type.tensor_type
        if info.name in seen or not info.type.HasField("tensor_type"):
            continue
        seen.add(info.name)
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in t.shape.dim]
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize if t.elem_type else 4
        total += float(np.prod(dims, dtype=np.float64)) * itemsize
    return total


def _feed(x, rng: np.random.Generator) -> np.ndarray:
    dtype = _ORT_TYPES.get(x.type)
    if dtype is None:
        raise InputError(f"input '{x.name}' has type {x.type}, which the run check cannot feed")
    shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in x.shape)
    if np.issubdtype(dtype, np.floating) and "mask" not in x.name:
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype) if dtype != np.bool_ else np.ones(shape, dtype)
