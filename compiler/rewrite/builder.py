"""One builder for patterns and replacements: `op.Mul(a, b)` matches in a pattern and emits in a rewrite.

    op.Softmax(scores, axis=-1)                    keyword arguments are ONNX attributes
    op.QuickGelu(x, _domain="com.microsoft")        `_`-prefixed keywords are options (ONNX has none)

In a pattern (`PATTERN`, what `Rule.pattern` receives) the call builds an `Op` pattern; its
inputs are patterns, attribute values are expected values or predicates, and the options are
`_name` (bind the node), `_check` (raises Refused), `_extra` (trailing inputs allowed), `_commute`.
In a rewrite (`Emit`, what `Rule.rewrite` receives) it appends the node and returns its output
tensor; its inputs are tensors and the options are `_dtype`, `_shape`, `_outputs` (a list back).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from mtkc.ir.graph_utils import Names
from mtkc.rewrite.pattern import Op


class Builder:
    """`op.<OpType>(*inputs, **attributes)` routed to `make`."""

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **kwargs: self.make(op_type, *inputs, **kwargs)

    def make(self, op_type: str, *inputs, **kwargs):
        raise NotImplementedError


class PatternBuilder(Builder):
    def make(self, op_type, *inputs, _domain="", _name=None, _check=None, _extra=False, _commute=None, **attrs):
        return Op(op_type, *inputs, domain=_domain, attrs=attrs, name=_name, check=_check, extra_inputs=_extra,
                  commute=_commute)


PATTERN = PatternBuilder()


class Emit(Builder):
    """Appends nodes named after the site they replace: `<prefix>/mtkc_<what>`, then `.../1`, ...

    Names come from one `graph_utils.Names` per graph, built on the first Emit and shared by the
    later ones. Only Emit makes `mtkc_` names, so names other generators add later cannot clash.
    """

    def __init__(self, graph: gs.Graph, prefix: str):
        self.graph, self.prefix = graph, prefix or "mtkc"
        state = vars(graph)  # (graphsurgeon's __getattr__ would treat a missing name as an op)
        if "_mtkc_names" not in state:
            state["_mtkc_names"] = Names(graph)
        self.names: Names = state["_mtkc_names"]

    def name(self, what: str) -> str:
        return self.names.new(f"{self.prefix}/mtkc_{what}")

    def const(self, what: str, values) -> gs.Constant:
        return gs.Constant(self.name(what), np.ascontiguousarray(values))

    def ints(self, what: str, *values: int) -> gs.Constant:
        """A 1-D int64 constant (shapes, axes, starts/ends)."""
        return self.const(what, np.array(values, np.int64))

    def scalar(self, what: str, value: float, like: gs.Tensor | None = None) -> gs.Constant:
        """A float scalar in `like`'s dtype (float32 when unknown)."""
        dtype = like.dtype if like is not None and like.dtype is not None else np.float32
        return self.const(what, np.array(value, np.dtype(dtype)))

    def negate(self, x: gs.Tensor) -> gs.Variable:
        """-x as Mul(x, -1) (no NeuroPilot tier converts Neg): -1 in x's dtype, of x's rank when known."""
        dtype = np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)
        rank = len(x.shape) if x.shape is not None else 0
        return self.Mul(x, self.const("minus_one", np.full([1] * rank, -1, dtype)), _dtype=x.dtype, _shape=x.shape)

    def make(self, op_type, *inputs, _domain="", _dtype=None, _shape=None, _outputs=1, **attrs):
        """Append `op_type`; returns its output Variable (a list when `_outputs` > 1).

        Without `_dtype`, the outputs take the first floating input's dtype (every op the LLM
        passes emit computes floats; a constant's dtype is known when upstream types are not).
        """
        if _dtype is None:
            _dtype = next((t.dtype for t in inputs if t.dtype is not None and np.dtype(t.dtype).kind == "f"), None)
        outs = [gs.Variable(self.name(f"{op_type.lower()}_out"), dtype=_dtype, shape=_shape) for _ in range(_outputs)]
        node = gs.Node(op_type, self.name(op_type.lower()), attrs=attrs, inputs=list(inputs), outputs=outs)
        if _domain:
            node.domain = _domain
        self.graph.nodes.append(node)
        return outs[0] if _outputs == 1 else outs

    def op(self, op_type: str, inputs: list, attrs: dict | None = None, domain: str = "", dtype=None,
           shape=None, outputs: int = 1):
        """`make` with the inputs as a list (kept for passes/gqa.py and passes/int4.py until they are ported)."""
        return self.make(op_type, *inputs, _domain=domain, _dtype=dtype, _shape=shape, _outputs=outputs,
                         **(attrs or {}))
