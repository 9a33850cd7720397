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
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
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


@pytest.mark.parametrize("scheme, fake", [("ptq4vit", False), ("ptq4vit", True), ("int8", False)])
def test_quantized_model_is_adaptable_and_close(calibrated_vit, calibration, tmp_path, scheme,
                                                fake):
    out = tmp_path / f"{scheme}.onnx"
    metadata = quantize_model(calibrated_vit, out, 8, calibration, scheme, fake_quant=fake)
    assert metadata.quantization["scheme"] == scheme and metadata.quantization["bits"] == 8
    x = uniform_batch(16, seed=9)
    fp32 = Policy.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
    quant = Policy.load(out, "eva0", seed=0, provider="cpu")
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
    fp32 = Policy.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
    cosines = {}
    for bits in (8, 6):
        out = tmp_path / f"w{bits}.onnx"
        quantize_model(calibrated_vit, out, bits, calibration, "ptq4vit")
        q = Policy.load(out, "noadapt", provider="cpu").predict(x)
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
    fp32 = Policy.load(calibrated_vit, "noadapt", provider="cpu").predict(x)
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
        q = Policy.load(out, "noadapt", provider="cpu").predict(x)
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
    captured = capsys.readouterr()
    assert "ptq4vit W6A6 (integer kernels)" in captured.out
    assert "searching scales" in captured.err and "layer" in captured.err  # the progress bar
    assert read_metadata(out).quantization["calibration_images"] == 32
    assert main(["info", "--model", str(out)]) == 0
    assert "ptq4vit W6A6; integer QDQ" in capsys.readouterr().out
    assert main(["quantize", "--model", str(out), "--bits", "8", "--calib",
                 str(tmp_path / "calib.npy"), "-o", str(tmp_path / "again.onnx")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_backprop_baselines_refuse_a_quantized_model(calibrated_vit, calibration, tmp_path):
    from eva0_edge.bench.testbed.evaluate import EvalSpec, method_factory

    out = tmp_path / "w8.onnx"
    quantize_model(calibrated_vit, out, 8, calibration, "int8")
    spec = EvalSpec(str(out), "fmnist-c", "single", 5, 8, ["tent"])
    with pytest.raises(ValueError, match="quantized"):
        method_factory(spec, "tent")
    assert method_factory(spec, "eva0")().step(uniform_batch(8)).shape == (8, 10)


def _layer_weights(model: onnx.ModelProto) -> dict[str, str]:
    """{layer node name: the initializer (or DequantizeLinear output) it uses as weight}."""
    producers = {o: n for n in model.graph.node for o in n.output}
    initializers = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm", "Conv"):
            for name in node.input[:2]:
                p = producers.get(name)
                if name in initializers or (p is not None and p.op_type == "DequantizeLinear"
                                            and p.input[0] in initializers):
                    out[node.name] = name
    return out


def test_integer_file_has_integer_weights_and_qdq_where_the_search_put_quantizers(
        calibrated_vit, calibration, tmp_path):
    """Every layer weight is an int8 initializer on its searched per-channel scales read through
    DequantizeLinear; every activation point gets its QuantizeLinear(s) and nothing else does;
    ORT's optimized graph runs integer MatMuls for every weight MatMul and the head; no float
    copy of a layer weight stays in the file."""
    fp32 = onnx.load(str(calibrated_vit))
    activations, weights = find_points(fp32)
    out = tmp_path / "w8.onnx"
    metadata = quantize_model(calibrated_vit, out, 8, calibration)
    model = onnx.load(str(out))
    initializers = {i.name: i for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    layer_weights = _layer_weights(model)
    assert len(layer_weights) == len(weights) == metadata.quantization["integer_weights"]
    for node_name, name in layer_weights.items():
        dq = producers[name]
        assert dq.op_type == "DequantizeLinear", node_name
        codes = initializers[dq.input[0]]
        assert codes.data_type == onnx.TensorProto.INT8
        assert len(initializers[dq.input[1]].dims) == 1  # one scale per output channel
    quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    per_point = {"uniform": 1, "per_head": 1, "twin_gelu": 1, "twin_softmax": 2}
    assert len(quantizers) == sum(per_point[p.kind] for p in activations)
    quantized_inputs = {n.name.split("/in")[0].removeprefix("quant/") for n in quantizers}
    assert quantized_inputs == {p.node for p in activations}
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    weight_matmuls = sum(1 for w in weights if w.node.startswith(("node_MatMul", "node_matmul",
                                                                  "node_linear", "node_Gemm")))
    assert ops.count("MatMulIntegerToFloat") == weight_matmuls > 0
    assert not {w.tensor for w in weights} & set(initializers)  # no float copy left behind


@pytest.mark.parametrize("bits", [8, 6])
def test_integer_logits_match_the_fake_quant_file(fmnist_vit_images, tmp_path, bits):
    """On 512 Fashion-MNIST test images, the shipped ViT's integer file is as close to the
    simulation as the simulation is to FP32 (mean |logit difference| within 1.5x) and agrees
    with its predictions on >= 97 % of images. Tolerance: by construction the two files differ
    only by the twin-GELU stand-in (one more k-bit grid) and float summation order, so the
    difference is one quantization's noise, the size of fake-quant's own distance to FP32
    (measured: 1.26x at 8 bits, 1.05x at 6; 99.4 % and 97.7 % agreement)."""
    from eva0_edge.bench.quant_eval import calibration_images

    model, x = fmnist_vit_images
    calibration = calibration_images(str(model))
    logits = {"fp32": Policy.load(model, "noadapt", provider="cpu").predict(x)}
    for fake in (True, False):
        path = tmp_path / f"{fake}.onnx"
        quantize_model(model, path, bits, calibration, fake_quant=fake)
        logits[fake] = Policy.load(path, "noadapt", provider="cpu").predict(x)
    integer_gap = np.abs(logits[False] - logits[True]).mean()
    simulation_gap = np.abs(logits[True] - logits["fp32"]).mean()
    assert integer_gap <= 1.5 * simulation_gap
    assert (logits[False].argmax(1) == logits[True].argmax(1)).mean() >= 0.97


@pytest.fixture(scope="module")
def fmnist_vit_images():
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
    from eva0_edge.runtime.preprocess import preprocess_uint8
    from tests.test_testbed import SHIPPED

    model = SHIPPED[0]
    images, _ = load_fashion_mnist("test")
    pick = np.random.default_rng(3).choice(len(images), 512, replace=False)
    return model, preprocess_uint8(images[pick], read_metadata(model).preprocessing)


def test_an_integer_file_is_served_and_adapts(calibrated_vit, calibration, tmp_path):
    """``serve --model`` an integer PTQ4ViT file: tritonclient gets logits, and it adapts."""
    import json

    import tritonclient.http as httpclient

    from tests.serving import ServerProcess, http_call

    out = tmp_path / "vit8bit.onnx"
    quantize_model(calibrated_vit, out, 8, calibration)
    server = ServerProcess(tmp_path / "serve.log", model=out)
    try:
        name = out.stem
        x = uniform_batch(8, seed=2)
        tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        for _ in range(2):
            result = server.client.infer(name, [tensor])
        assert result.as_numpy("logits").shape == (8, 10)
        status, body = http_call(server, "GET", f"/v2/models/{name}/adaptation/statistics")
        assert status == 200 and json.loads(body)["steps"] == 2
    finally:
        server.stop()
