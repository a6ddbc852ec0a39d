"""`OUT/manifest.json`: what `mtkc compile` wrote and how the pieces connect (DESIGN.md).

    {"schema_version", "sdk", "arch", "options",
     "graphs": [{"name", "path", "inputs": [{"name", "dtype", "shape", ["from"]}], "outputs", "partitions"}],
     "coverage", "passes": [{"name", "rewrites", "nodes_before", "nodes_after"}],
     "model": {"path", "sha256"}}

`options.mask_value` is always recorded (the value the host mask uses), with `mask_value_source`
("option": given by the user or config, "default": `mtkc.contract.mask.DEFAULT_VALUE`).
`model.sha256` is the compiled ONNX file's digest: verify refuses another model.

`graphs[].decoder` is the graph's quantisation units, found by structure (`decoder_entry`):
`{"layers": [{"index", "output", "nodes"}], "lm_head"}`: layer i's node names (`mtkc.analysis.regions`;
i is the one `past_key_<i>`, `--chunks` and `check` use), the tensor leaving it, and the LM head's
MatMul/Gemm (null when the graph has no logits). verify --quant and convert --plan read it.

A graph input made by an earlier graph (layer chunks: chunk k's `hidden_states` is chunk k-1's
`hidden_states_out`) carries `"from": {"graph", "output"}`; runtimes and verify wire by it.

Deterministic by construction: keys sorted, paths relative to OUT, no timestamps and no
timings (per-pass seconds go to report.json), so the same input and options give the same
bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.analysis.decoder import decoder_map
from mtkc.analysis.regions import layer_regions
from mtkc.contract import io, mask
from mtkc.errors import InputError

log = logging.getLogger("mtkc")

SCHEMA_VERSION = 1


def tensor_spec(t: gs.Tensor) -> dict[str, Any]:
    """{"name", "dtype", "shape"}: dtype as a numpy name, symbolic dims as strings."""
    dtype = None if t.dtype is None else np.dtype(t.dtype).name if _is_numpy(t.dtype) else str(t.dtype)
    shape = None if t.shape is None else [int(d) if isinstance(d, (int, np.integer)) else (None if d is None else str(d)) for d in t.shape]
    return {"name": t.name, "dtype": dtype, "shape": shape}


def graph_entry(name: str, path: str, graph: gs.Graph, partitions: list[dict] | None = None,
                sources: dict[str, dict] | None = None) -> dict[str, Any]:
    """`sources`: graph inputs made by an earlier graph, input name -> {"graph", "output"} (input `from`)."""
    sources = sources or {}
    return {
        "name": name,
        "path": path,
        "inputs": [{**tensor_spec(t), **({"from": sources[t.name]} if t.name in sources else {})} for t in graph.inputs],
        "outputs": [tensor_spec(t) for t in graph.outputs],
        "partitions": list(partitions or []),
    }


def decoder_entry(graph: gs.Graph) -> dict[str, Any]:
    """`graphs[].decoder` of a compiled graph (see the module docstring). A layer's index is its cache's
    contract number (`past_key_<i>`: a layer chunk's first layer is not 0), else the map's."""
    dm = decoder_map(graph)
    try:
        regions = layer_regions(graph, dm)
    except InputError as exc:  # a pipeline without the contract I/O (--passes): no units, said once
        log.warning("mtkc: graph without decoder layer units (%s): verify --quant reports no layer", exc)
        regions = {}
    layers = []
    for index, region in regions.items():
        parsed = io.cache_name(dm.layers[index].past.get("key", ""))
        layers.append({"index": parsed[2] if parsed else index, "nodes": [n.name for n in region.nodes],
                       "output": region.output.name if region.output is not None else None})
    has_logits = any(o.name == io.LOGITS for o in graph.outputs)
    return {"layers": layers, "lm_head": dm.logits if has_logits else None}


def build(
    sdk: str,
    arch: str | None,
    options: dict[str, Any],
    graphs: list[dict[str, Any]],
    coverage: dict[str, Any],
    passes: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "sdk": sdk,
        "arch": arch,
        "options": {**options, "mask_value": mask.value_of(options),
                    "mask_value_source": "default" if options.get("mask_value") is None else "option"},
        "graphs": graphs,
        "coverage": coverage,
        "passes": passes,
    }


def source(path: str, sha256: str | None) -> dict[str, Any]:
    """The manifest's `model`: the compiled file (absolute path) and its sha256."""
    return {"path": path, "sha256": sha256}


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dumps(data: dict[str, Any]) -> str:
    """Canonical JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _is_numpy(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False
