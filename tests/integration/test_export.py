"""The exporter's contract: the ONNX graph equals timm run sample by sample with per-row theta."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from eva0_edge.runtime.modelfile import read_metadata
from tests.fixtures import ExportedModel, export_small
from tests.timm_reference import load_timm, timm_outputs

TOL = 1e-4


def _session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _random_theta(theta0: np.ndarray, rows: int, rng: np.random.Generator) -> np.ndarray:
    return (theta0 + 0.2 * rng.standard_normal((rows, theta0.size))).astype(np.float32)


def _check_per_sample(exported: ExportedModel, batch: int = 4) -> None:
    rng = np.random.default_rng(0)
    metadata = read_metadata(exported.onnx_path)
    session = _session(exported.onnx_path)
    x = rng.standard_normal((batch, *metadata.preprocessing.input_size)).astype(np.float32)
    theta = _random_theta(metadata.theta0, batch, rng)
    logits, features = session.run(None, {"pixel_values": x, "theta": theta})
    ref_logits, ref_features = timm_outputs(
        load_timm(exported.arch, exported.kwargs, exported.checkpoint), metadata, x, theta
    )
    assert logits.shape == (batch, metadata.num_classes)
    assert features.shape == (batch, metadata.num_features)
    np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
    np.testing.assert_allclose(features, ref_features, atol=TOL, rtol=0)


def test_per_sample_theta_matches_timm(small_model):
    _check_per_sample(small_model)


def test_theta0_reproduces_unmodified_timm(small_model):
    rng = np.random.default_rng(1)
    metadata = read_metadata(small_model.onnx_path)
    x = rng.standard_normal((3, *metadata.preprocessing.input_size)).astype(np.float32)
    theta = np.tile(metadata.theta0, (3, 1))
    logits, _ = _session(small_model.onnx_path).run(None, {"pixel_values": x, "theta": theta})
    model = load_timm(small_model.arch, small_model.kwargs, small_model.checkpoint)
    import torch

    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, expected, atol=TOL, rtol=0)


def test_batch_one_row_equals_batch_n_row(small_model):
    rng = np.random.default_rng(2)
    metadata = read_metadata(small_model.onnx_path)
    session = _session(small_model.onnx_path)
    x = rng.standard_normal((5, *metadata.preprocessing.input_size)).astype(np.float32)
    theta = _random_theta(metadata.theta0, 5, rng)
    logits, features = session.run(None, {"pixel_values": x, "theta": theta})
    for i in (0, 3):
        li, fi = session.run(None, {"pixel_values": x[i : i + 1], "theta": theta[i : i + 1]})
        np.testing.assert_allclose(li[0], logits[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(fi[0], features[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("copies", [2, 3])
def test_shared_prefix_equals_plain_path(small_model, copies):
    """x [B] with theta [copies*B] (prefix once, tiled) == x tiled to [copies*B] (no sharing)."""
    rng = np.random.default_rng(3)
    metadata = read_metadata(small_model.onnx_path)
    session = _session(small_model.onnx_path)
    x = rng.standard_normal((4, *metadata.preprocessing.input_size)).astype(np.float32)
    theta = _random_theta(metadata.theta0, copies * 4, rng)
    shared = session.run(None, {"pixel_values": x, "theta": theta})
    plain = session.run(None, {"pixel_values": np.concatenate([x] * copies), "theta": theta})
    for a, b in zip(shared, plain, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_metadata_layout(small_vit, small_resnet_gn):
    vit = read_metadata(small_vit.onnx_path)
    assert vit.family == "vit"
    assert [s.name for s in vit.theta_layout[:4]] == [
        "blocks.1.norm1.weight", "blocks.1.norm1.bias",
        "blocks.1.norm2.weight", "blocks.1.norm2.bias",
    ]
    assert vit.num_params == 4 * 4 * 64  # blocks 1..4, norm1/norm2, weight/bias, D = 64
    assert vit.num_features == 6 * 64  # CLS after each of the 6 blocks
    rgn = read_metadata(small_resnet_gn.onnx_path)
    assert rgn.family == "resnet_gn"
    assert all(s.name.split(".")[0] in {"layer1", "layer2", "layer3"} for s in rgn.theta_layout)
    assert [s.size for s in rgn.feature_layout] == [64, 128, 256, 512]


def test_model_loads_without_warnings(small_model, capfd):
    options = ort.SessionOptions()
    options.log_severity_level = 1  # info and up: warnings would show
    ort.InferenceSession(str(small_model.onnx_path), options, providers=["CPUExecutionProvider"])
    assert "W:" not in capfd.readouterr().err


def test_custom_adapt_range(tmp_path):
    from tests.fixtures import SMALL_VIT

    exported = export_small(tmp_path, *SMALL_VIT, adapt="0,3-4")
    metadata = read_metadata(exported.onnx_path)
    assert {s.name.split(".")[1] for s in metadata.theta_layout} == {"0", "3", "4"}
    assert metadata.prefix == "patch_embed"
    _check_per_sample(exported, batch=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["vit_base_patch16_224", "resnet50_gn"]
)
def test_full_size_per_sample_matches_timm(tmp_path, arch):
    import timm
    import torch

    from eva0_edge.exporter import export_model

    torch.manual_seed(0)
    model = timm.create_model(arch).eval()
    checkpoint = tmp_path / "ckpt.pth"
    torch.save(model.state_dict(), checkpoint)
    export_model(arch, tmp_path / "m.onnx", checkpoint=checkpoint)
    exported = ExportedModel(arch, {}, checkpoint, tmp_path / "m.onnx", (3, 224, 224))
    _check_per_sample(exported, batch=2)
