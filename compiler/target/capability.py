"""Capability tables: what each NeuroPilot SDK's NPU accepts, and a verdict per ONNX node.

A table is a TOML file `opsets/neuropilot-<ver>.toml` (read with importlib.resources). It names
its MDLA archs, its sources, table-wide defaults, and one entry per (domain, op type) built from a
fixed vocabulary of constraint kinds, each an executable predicate:

    host            {input, const_rows_over}: a lookup in a big table host-op (target "host")
    max_rank        rank of every input and output                    rank-unsupported
    dtypes          allowed dtypes of every input and output        dtype-unsupported
    input_dtypes    {"<index>": [...]}: overrides `dtypes` for one input
    const_dtypes    also accepted on constant inputs (int64 shapes/axes: the converter casts
                    them to int32, so their values must fit; read only when <= 1024 elements)
    static_shapes   every input/output dim is a known integer         shape-dynamic
    const_inputs    these input indices must be constants             input-not-constant
    attributes      {name: [allowed values]}; [] = must be absent     attribute-unsupported
    last_axis       this attribute (or `axes` input) is the last axis attribute-unsupported
    broadcast       "equal-rank": activation inputs share one rank    broadcast-unsupported

A node's verdict is the first failing check, in this order (a lookup that moves to the host is
not judged further; constants of lower rank may broadcast, the converter expands them).

An entry with `supported = false` documents an op that never runs on the NPU (op-unsupported);
an op without an entry is op-not-in-table; a domain no entry uses is unknown-domain. A table may
`extends` an older one (entries replace whole entries); its `archs` may replace entries for one
MDLA arch. Unknown keys, bad values or unknown source ids are load errors naming file and key.

This module is the package's front: the loader (`loader`), the table model (`model`), the
constraint predicates (`predicates`) and remedy text (`remedies`) live in modules of their own.
"""

from mtkc.target.loader import Catalog, available_sdks, load_table, normalize_sdk
from mtkc.target.model import CONSTRAINTS, DTYPES, PROVENANCE, REASONS, SUPPORTED, Entry, Remedy, Table, Verdict
from mtkc.target.predicates import DEFAULT_DOMAIN
from mtkc.target.remedies import remedy_text

__all__ = ["CONSTRAINTS", "DEFAULT_DOMAIN", "DTYPES", "PROVENANCE", "REASONS", "SUPPORTED", "Catalog", "Entry", "Remedy", "Table",
           "Verdict", "available_sdks", "load_table", "normalize_sdk", "remedy_text"]
