"""`quantstream`: the weights' codes streamed block by block are onnxruntime's own, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from mtkc.pipeline import quantstream
from mtkc.pipeline.quantstream import channel_absmax, grid_scales, quantised


@pytest.mark.parametrize("bits,qtype", [(4, onnx.TensorProto.INT4), (8, onnx.TensorProto.INT8),
                                        (16, onnx.TensorProto.INT16)])
@pytest.mark.parametrize("shape,axis", [((37, 23), 1), ((23, 37), 0), ((5, 3, 2, 2), 0)])
def test_codes_in_blocks_are_onnxruntimes_quantize_onnx_initializer(bits, qtype, shape, axis, monkeypatch):
    from onnxruntime.quantization.quant_utils import ONNX_TYPE_TO_NP_TYPE, quantize_onnx_initializer

    monkeypatch.setattr(quantstream, "BLOCK", 50)  # several blocks of rows
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal(shape) * 3).astype(np.float32)
    w.reshape(-1)[::7] = 0.0
    absmax = channel_absmax(w, axis)
    assert np.array_equal(absmax, np.abs(np.moveaxis(w, axis, 0).reshape(shape[axis], -1)).max(1))
    scales = grid_scales(absmax, bits)
    ours = np.concatenate([b.reshape(-1) for b in quantised(w, axis, scales, bits)]).astype(np.int64)
    zero = np.zeros(shape[axis], ONNX_TYPE_TO_NP_TYPE[qtype])
    reference = quantize_onnx_initializer(numpy_helper.from_array(w, "w"), qtype, zero, scales, axis)
    assert np.array_equal(ours, numpy_helper.to_array(reference).reshape(-1).astype(np.int64))
    assert ours.min() >= -(2 ** (bits - 1)) and ours.max() <= 2 ** (bits - 1) - 1
