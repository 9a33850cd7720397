"""Shared fixtures: small exported models (built once per test session), and a cache of the
session's own."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

_SESSION_CACHE = pytest.StashKey["Path | None"]()


def pytest_configure(config) -> None:
    """What the tests generate (corrupted splits, prompt variants, split sessions, heads) goes
    to a cache of this test session's own, removed at its end, never the user's
    (``$EVA0_CACHE``, ``~/.cache/eva0-edge``); ``EVA0_TEST_CACHE`` names a folder to keep and
    reuse instead. Server processes the tests start inherit it."""
    kept = os.environ.get("EVA0_TEST_CACHE")
    cache = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="eva0-test-cache-"))
    config.stash[_SESSION_CACHE] = None if kept else cache
    os.environ["EVA0_CACHE"] = str(cache)


def pytest_unconfigure(config) -> None:
    cache = config.stash.get(_SESSION_CACHE, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)

SMALL_VIT = (
    "vit_tiny_patch16_224",
    {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 6, "num_heads": 2,
     "num_classes": 10},
)
SMALL_RESNET_GN = (
    "resnet18",
    {"norm_layer": "groupnorm", "layers": [1, 1, 1, 1], "num_classes": 10},
)


@dataclass
class ExportedModel:
    """An exported adaptable model and the checkpoint it came from."""

    arch: str
    kwargs: dict
    checkpoint: Path
    onnx_path: Path
    input_size: tuple[int, int, int]


def export_small(tmp_dir: Path, arch: str, kwargs: dict, seed: int = 0, **export_kw):
    import timm
    import torch

    from eva0_edge.exporter import export_model

    torch.manual_seed(seed)
    model = timm.create_model(arch, **kwargs).eval()
    checkpoint = tmp_dir / f"{arch}.pth"
    torch.save(model.state_dict(), checkpoint)
    onnx_path = tmp_dir / f"{arch}.onnx"
    metadata = export_model(
        arch, onnx_path, checkpoint=checkpoint, model_kwargs=kwargs,
        input_size=(3, 32, 32), **export_kw,
    )
    return ExportedModel(arch, kwargs, checkpoint, onnx_path, metadata.preprocessing.input_size)


@pytest.fixture(scope="session")
def small_vit(tmp_path_factory) -> ExportedModel:
    return export_small(tmp_path_factory.mktemp("vit"), *SMALL_VIT)


@pytest.fixture(scope="session")
def small_resnet_gn(tmp_path_factory) -> ExportedModel:
    return export_small(tmp_path_factory.mktemp("rgn"), *SMALL_RESNET_GN)


@pytest.fixture(scope="session")
def prompt_vit(tmp_path_factory) -> ExportedModel:
    """The small ViT in black-box prompt mode (2 prompt tokens), with source statistics from
    64 random images."""
    import numpy as np

    from eva0_edge.runtime.calibrate import calibrate_with_images

    exported = export_small(tmp_path_factory.mktemp("prompt"), *SMALL_VIT, prompts=2)
    images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    calibrate_with_images(exported.onnx_path, images)
    return exported


@pytest.fixture(scope="session", params=["vit", "resnet_gn"])
def small_model(request, small_vit, small_resnet_gn) -> ExportedModel:
    return small_vit if request.param == "vit" else small_resnet_gn


@pytest.fixture(scope="session")
def calibrated_vit(small_vit, tmp_path_factory):
    """The small ViT with source statistics from 64 random 'clean' images."""
    import numpy as np

    from eva0_edge.runtime.calibrate import feature_statistics, write_source_stats
    from eva0_edge.runtime.data import open_input
    from eva0_edge.runtime.modelfile import read_metadata
    from eva0_edge.runtime.session import AdaptableSession

    out = tmp_path_factory.mktemp("cal")
    rng = np.random.default_rng(0)
    np.save(out / "clean.npy", rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8))
    metadata = read_metadata(small_vit.onnx_path)
    session = AdaptableSession(small_vit.onnx_path, metadata, "cpu")
    stream = open_input(out / "clean.npy", metadata.preprocessing)
    mean, std = feature_statistics(session, stream, 32, progress=False)
    write_source_stats(small_vit.onnx_path, out / "calibrated.onnx", mean, std)
    return out / "calibrated.onnx"


def uniform_batch(n: int, seed: int = 0, size=(3, 32, 32)):
    """Normalised pixels as a [0, 1] image normalised with mean = std = 0.5 gives: [-1, 1]."""
    import numpy as np

    return np.random.default_rng(seed).uniform(-1, 1, (n, *size)).astype(np.float32)


# Fixtures and modules that make a test an integration test: timm exports, real server
# processes, the Fashion-MNIST split and the benchmarks. `make test-fast` leaves them out.
INTEGRATION_FIXTURES = {
    "small_vit", "small_resnet_gn", "prompt_vit", "wide_prompt_vit", "small_model",
    "calibrated_vit", "server", "fmnist_clean", "fmnist_vit_images",
}
INTEGRATION_MODULES = {
    "tests.test_serve", "tests.test_hostile", "tests.test_testbed", "tests.test_cost_bench",
    "tests.test_export",
    "tests.test_fleet", "tests.test_fanout",
    "tests.test_cuda",
    "tests.test_guard", "tests.test_inputwatch",  # Fashion-MNIST streams throughout
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if (INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
                or item.module.__name__ in INTEGRATION_MODULES):
            item.add_marker(pytest.mark.integration)
