"""Quantization: fake quantizers by hand, the ONNX nodes equal to NumPy, and quantized files that
stay adaptable models close to FP32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from eva0_edge.cli import main
from eva0_edge.quant import quantize_model
from eva0_edge.quant.points import find_points
from eva0_edge.quant.quantizers import Quantizer, onnx_nodes, twin_gelu, twin_softmax, uniform
from eva0_edge.runtime.engine import AdaptiveModel
from eva0_edge.runtime.modelfile import read_metadata
from tests.conftest import uniform_batch


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


def test_vit_points_get_the_ptq4vit_quantizers(small_vit):
    activations, weights = find_points(onnx.load(str(small_vit.onnx_path)))
    kinds = [p.kind for p in activations]
    depth = 6
    assert kinds.count("twin_softmax") == depth and kinds.count("twin_gelu") == depth
    assert kinds.count("per_head") == 3 * depth  # q, k^T, v
    assert len(weights) == 4 * depth + 2  # qkv, proj, fc1, fc2 per block; patch conv; head


@pytest.fixture(scope="module")
def calibration():
    return uniform_batch(32, seed=5)


@pytest.mark.parametrize("scheme", ["ptq4vit", "int8"])
def test_quantized_model_is_adaptable_and_close(calibrated_vit, calibration, tmp_path, scheme):
    out = tmp_path / f"{scheme}.onnx"
    metadata = quantize_model(calibrated_vit, out, 8, calibration, scheme)
    assert metadata.quantization["scheme"] == scheme and metadata.quantization["bits"] == 8
    x = uniform_batch(16, seed=9)
    fp32 = AdaptiveModel.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
    quant = AdaptiveModel.load(out, "eva0", seed=0, provider="cpu")
    logits = quant.predict(x)
    cosine = (fp32 * logits).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(logits, axis=1)
    assert cosine.min() >= 0.99
    session = quant.session
    theta = np.repeat(quant.metadata.theta0[None], len(x), axis=0)
    shifted = theta + np.random.default_rng(0).normal(0, 0.2, theta.shape).astype(np.float32)
    assert np.abs(session.run(x, theta)[0] - session.run(x, shifted)[0]).max() > 1e-2
    for _ in range(3):
        quant.step(x)
    stats = quant.stats()
    assert stats["steps"] == 3 and stats["skipped_steps"] == 0 and stats["drift"] > 0


def test_six_bits_stay_within_reach(calibrated_vit, calibration, tmp_path):
    x = uniform_batch(16, seed=9)
    fp32 = AdaptiveModel.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
    cosines = {}
    for bits in (8, 6):
        out = tmp_path / f"w{bits}.onnx"
        quantize_model(calibrated_vit, out, bits, calibration, "ptq4vit")
        q = AdaptiveModel.load(out, "noadapt", provider="cpu").predict(x)
        cosines[bits] = float(((fp32 * q).sum(1) / np.linalg.norm(fp32, axis=1)
                               / np.linalg.norm(q, axis=1)).mean())
    assert cosines[8] > cosines[6] > 0.9


def test_the_int8_schemes_six_bits_are_six_bit_grids(calibrated_vit, calibration, tmp_path):
    """At 6 bits every integer weight lies in [-32, 31] and every activation QuantizeLinear
    (uint8, zero point 128) feeds a Clip to [96, 159]: 64 levels each; at 8 bits the weights
    use the int8 range. The 6-bit model is further from fp32 than the 8-bit one."""
    import onnx
    from onnx import numpy_helper

    x = uniform_batch(16, seed=9)
    fp32 = AdaptiveModel.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
    spans, cosines = {}, {}
    for bits in (8, 6):
        out = tmp_path / f"int{bits}.onnx"
        quantize_model(calibrated_vit, out, bits, calibration, "int8")
        model = onnx.load(out)
        weights = [numpy_helper.to_array(i) for i in model.graph.initializer
                   if i.data_type == onnx.TensorProto.INT8]
        spans[bits] = (min(int(w.min()) for w in weights), max(int(w.max()) for w in weights))
        clips = [n for n in model.graph.node if n.op_type == "Clip" and n.name.endswith("clip6")]
        quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
        if bits == 6:
            assert len(clips) == len(quantizers) > 0
        else:
            assert not clips
        q = AdaptiveModel.load(out, "noadapt", provider="cpu").predict(x)
        cosines[bits] = float(((fp32 * q).sum(1) / np.linalg.norm(fp32, axis=1)
                               / np.linalg.norm(q, axis=1)).mean())
    assert spans[6][0] >= -32 and spans[6][1] <= 31
    assert spans[8][0] < -32 or spans[8][1] > 31
    assert cosines[8] > cosines[6]


def test_quantize_cli(calibrated_vit, tmp_path, capsys):
    np.save(tmp_path / "calib.npy", (np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3)))
            .astype(np.uint8))
    out = tmp_path / "vit6.onnx"
    assert main(["quantize", "--model", str(calibrated_vit), "--bits", "6", "--calib",
                 str(tmp_path / "calib.npy"), "-o", str(out)]) == 0
    assert "ptq4vit W6A6" in capsys.readouterr().out
    assert read_metadata(out).quantization["calibration_images"] == 32
    assert main(["quantize", "--model", str(out), "--bits", "8", "--calib",
                 str(tmp_path / "calib.npy"), "-o", str(tmp_path / "again.onnx")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_backprop_baselines_refuse_a_quantized_model(calibrated_vit, calibration, tmp_path):
    from eva0_edge.bench.evaluate import EvalSpec, method_factory

    out = tmp_path / "w8.onnx"
    quantize_model(calibrated_vit, out, 8, calibration, "int8")
    spec = EvalSpec(str(out), "fmnist-c", "single", 5, 8, ["tent"])
    with pytest.raises(ValueError, match="quantized"):
        method_factory(spec, "tent")
    assert method_factory(spec, "eva0")().step(uniform_batch(8)).shape == (8, 10)
