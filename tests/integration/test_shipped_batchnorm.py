"""The shipped BatchNorm model (issue 47 item 3): its theta is the torch model's BatchNorm
affines, it quantizes to integer convolutions (QLinearConv) that keep its predictions, and
the int8 file is served over the Open Inference Protocol, adapting."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from eva0_edge.bench.testbed.backprop import load_torch_source
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from eva0_edge.quant import quantize_model
from eva0_edge.runtime import load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.fixtures import SHIPPED_BN, ServerProcess, http_call


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory):
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    out = tmp_path_factory.mktemp("int8") / "mobilenet_bn_fmnist_int8.onnx"
    calibration = preprocess_uint8(images[train_idx][:64], read_metadata(SHIPPED_BN).preprocessing)
    quantize_model(SHIPPED_BN, out, 8, calibration, scheme="int8")
    return out


def _test_images(count: int):
    images, labels = load_fashion_mnist("test")
    return images[:count], labels[:count]


def test_theta_is_the_torch_models_batchnorm_affines():
    metadata = read_metadata(SHIPPED_BN)
    assert metadata.family == "mobilenetv3"
    assert all(s.name.startswith(("blocks.3.", "blocks.4.", "blocks.5."))
               and ".bn" in s.name for s in metadata.theta_layout)
    model = load_torch_source(metadata)  # checks theta0 against the state dict
    images, _ = _test_images(64)
    x = preprocess_uint8(images, metadata.preprocessing)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = load_method(SHIPPED_BN, "noadapt").predict(x)
    assert np.abs(got - want).max() <= 1e-4


def test_int8_file_runs_integer_convolutions_and_keeps_the_predictions(int8_file, tmp_path):
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(int8_file), options, providers=["CPUExecutionProvider"])
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    assert ops["QLinearConv"] >= 50 and ops["BatchNormalization"] == 0
    images, labels = _test_images(1000)
    float_model, int8_model = load_method(SHIPPED_BN, "noadapt"), load_method(int8_file, "noadapt")
    x = preprocess_uint8(images, float_model.metadata.preprocessing)
    float_top1 = float_model.predict(x).argmax(1)
    int8_top1 = int8_model.predict(x).argmax(1)
    assert (float_top1 == int8_top1).mean() >= 0.97
    assert (int8_top1 == labels).mean() >= (float_top1 == labels).mean() - 0.01


def test_int8_file_is_served_and_adapts(int8_file, tmp_path):
    import tritonclient.http as httpclient

    images, labels = _test_images(64)
    x = preprocess_uint8(images, read_metadata(int8_file).preprocessing)
    server = ServerProcess(tmp_path / "serve.log", "--method", "eva0", model=int8_file)
    try:
        served = []
        for i in range(0, 64, 16):
            request = httpclient.InferInput("pixel_values", [16, 3, 32, 32], "FP32")
            request.set_data_from_numpy(np.ascontiguousarray(x[i: i + 16]))
            served.append(server.client.infer(int8_file.stem, [request]).as_numpy("logits"))
        status, body = http_call(server, "GET",
                                 f"/v2/models/{int8_file.stem}/adaptation/statistics")
        assert status == 200
        stats = json.loads(body)
    finally:
        server.stop()
    top1 = np.concatenate(served).argmax(1)
    assert (top1 == labels).mean() >= 0.85
    assert stats["steps"] >= 1 and stats["drift"] > 0
