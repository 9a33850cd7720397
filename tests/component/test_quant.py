"""Quantization: fake quantizers by hand, the ONNX nodes equal to NumPy, and quantized files that
stay adaptable models close to FP32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from eva0_edge.quant.qdq import activation_nodes
from eva0_edge.quant.quantizers import (
    Quantizer,
    gelu_zero_point,
    integer_gelu,
    integer_twin_softmax,
    onnx_nodes,
    twin_gelu,
    twin_softmax,
    uniform,
)


def test_uniform_matches_hand_computation():
    x = np.array([-1.0, -0.26, 0.0, 0.1, 0.24, 0.26, 5.0])
    # 4 bit, step 0.25: levels -8..7 -> values -2.0..1.75
    np.testing.assert_allclose(uniform(x, 0.25, 4), [-1.0, -0.25, 0.0, 0.0, 0.25, 0.25, 1.75])
    w = np.array([[1.0, -3.0], [0.5, 2.0]])
    np.testing.assert_allclose(  # per column: steps 1 and 0.5
        uniform(w, np.array([[1.0, 0.5]]), 3), [[1.0, -2.0], [0.0, 1.5]]
    )


def test_twin_softmax_matches_hand_computation():
    # 4 bit: 8 levels per range; R2 step 1/8 on [0, 1); m = 2: R1 step 1/32 on [0, 8/32 = 0.25)
    x = np.array([0.0, 0.01, 0.05, 0.2, 0.26, 0.5, 0.99])
    expected = [0.0, 0.0, 2 / 32, 6 / 32, 2 / 8, 4 / 8, 7 / 8]
    np.testing.assert_allclose(twin_softmax(x, 2, 4), expected)


def test_integer_twin_softmax_moves_only_the_sliver_below_the_threshold():
    """The sum-of-two-codes form equals the simulation everywhere but on [T - d1/2, T), which
    it rounds up to T (a coarse value) instead of clamping to T - d1 (4 bit, m = 2: T = 0.25,
    d1 = 1/32)."""
    x = np.concatenate([np.linspace(0, 1, 4001), [0.234, 0.2343, 0.249, 0.25]])
    got, want = integer_twin_softmax(x, 2, 4), twin_softmax(x, 2, 4)
    sliver = (x >= 0.25 - 1 / 64) & (x < 0.25)
    np.testing.assert_allclose(got[~sliver], want[~sliver], atol=1e-12)
    assert sliver.sum() > 10
    np.testing.assert_allclose(got[sliver], 0.25)
    np.testing.assert_allclose(want[sliver], 0.25 - 1 / 32)
    assert np.unique(got).size <= 2 * 8  # still values of the two 3-bit grids


def test_twin_gelu_matches_hand_computation():
    # 4 bit: R1 step 0.17/8 for negatives (down to -0.17); m = 3: R2 step 0.17 for positives
    d1, d2 = 0.17 / 8, 0.17
    x = np.array([-0.17, -0.05, -0.001, 0.0, 0.1, 0.3, 2.0])
    expected = [-8 * d1, -2 * d1, 0.0, 0.0, d2, 2 * d2, 7 * d2]
    np.testing.assert_allclose(twin_gelu(x, 3, 4), expected)


@pytest.mark.parametrize("quantizer, data", [
    (Quantizer("uniform", 8, scale=np.float32(0.02)), np.linspace(-3, 3, 101)),
    (Quantizer("uniform", 6, scale=np.array([0.1, 0.3], np.float32).reshape(1, 2, 1, 1)),
     np.linspace(-4, 4, 2 * 3 * 5)),
    (Quantizer("twin_softmax", 6, m=3), np.linspace(0, 1, 101)),
    (Quantizer("twin_gelu", 8, m=5), np.linspace(-0.17, 4, 101)),
])
def test_onnx_nodes_equal_numpy(quantizer, data):
    x = data.astype(np.float32).reshape(1, 2, -1, 1) if data.size % 2 == 0 else \
        data.astype(np.float32).reshape(1, 1, -1, 1)
    nodes, constants, out = onnx_nodes(quantizer, "x", "q")
    graph = helper.make_graph(
        nodes, "fq", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)], constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], quantizer(x), atol=1e-6)


def _run_nodes(nodes, constants, out, x):
    graph = helper.make_graph(
        nodes, "q", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)], constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("quantizer, data, expected", [
    (Quantizer("uniform", 8, scale=np.float32(0.02)), np.linspace(-3, 3, 102), uniform),
    (Quantizer("uniform", 6, scale=np.float32(0.05)), np.linspace(-3, 3, 102), uniform),
    (Quantizer("uniform", 6, scale=np.array([0.1, 0.3], np.float32).reshape(1, 2, 1, 1)),
     np.linspace(-12, 12, 102), uniform),
    (Quantizer("twin_softmax", 8, m=3), np.linspace(0, 1, 102), integer_twin_softmax),
    (Quantizer("twin_softmax", 6, m=4), np.linspace(0, 1, 102), integer_twin_softmax),
    (Quantizer("twin_softmax", 6, m=5), np.linspace(0, 1, 102), integer_twin_softmax),
    (Quantizer("twin_softmax", 6, m=7), np.linspace(0, 1, 102), twin_softmax),  # T < d2
    (Quantizer("twin_gelu", 8, m=5, step=0.03), np.linspace(-0.17, 9, 102), integer_gelu),
    (Quantizer("twin_gelu", 6, m=5, step=0.1), np.linspace(-0.17, 9, 102), integer_gelu),
])
def test_integer_encoding_equals_numpy(quantizer, data, expected):
    """The QuantizeLinear / Clip / DequantizeLinear encoding of every quantizer computes what
    the simulation computes (twin GELU: its one-code stand-in; twin softmax with m <= k - 1:
    its sum of two codes), on values across the range and beyond it (clipping)."""
    thresholds = np.array([2 ** (quantizer.bits - 1) / 2**quantizer.m / 2 ** (quantizer.bits - 1)
                           if quantizer.kind == "twin_softmax" else 0.0])
    near = (thresholds[:, None] + np.linspace(-0.01, 0.01, 400)[None]).reshape(-1)
    data = np.concatenate([data, near[(near >= data.min()) & (near <= data.max())]])
    data = data[: len(data) // 2 * 2]
    x = data.astype(np.float32).reshape(1, 2, -1, 1)
    want = {uniform: lambda v: uniform(v, quantizer.scale, quantizer.bits),
            twin_softmax: lambda v: twin_softmax(v, quantizer.m, quantizer.bits),
            integer_twin_softmax: lambda v: integer_twin_softmax(v, quantizer.m, quantizer.bits),
            integer_gelu: lambda v: integer_gelu(v, quantizer.step, quantizer.bits)}[expected](x)
    got = _run_nodes(*activation_nodes(quantizer, "x", "q"), x)
    np.testing.assert_allclose(got, want, atol=1e-6)
    levels = np.unique(np.round(got / (np.abs(got).max() or 1), 6)).size
    assert levels <= 2**quantizer.bits  # never more codes than the width has


@pytest.mark.parametrize("step", [0.03, 0.05, 0.06, 0.1])
def test_integer_gelu_stand_in_covers_gelus_range(step):
    """The stand-in reaches GELU's minimum without clipping (error within half a step from
    -0.17 up) and keeps 2^k codes."""
    bits = 6
    top = (2**bits - 1 - gelu_zero_point(step)) * step
    x = np.linspace(-0.17, top, 2000)
    assert np.abs(integer_gelu(x, step, bits) - x).max() <= step / 2 + 1e-9
    assert np.unique(integer_gelu(np.linspace(-1, 100, 10000), step, bits)).size == 2**bits
