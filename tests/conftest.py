"""The test session: its tiers (by folder), a cache of its own, the data set out of reach below
the integration tier, and the small exported models (built once per session). Paths, servers and
data helpers: :mod:`tests.fixtures`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.fixtures import SMALL_RESNET_GN, SMALL_VIT, ExportedModel, export_small

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


TIERS = ("unit", "component", "integration")


def pytest_collection_modifyitems(config, items) -> None:
    """A test's tier is its folder: tests/unit (no model file, no ORT session), tests/component
    (ORT sessions on the shipped models, in-process servers), tests/integration (timm exports,
    server processes, the Fashion-MNIST split, Ray, the benchmarks). `make test-fast` runs the
    first two (``-m "not slow and not integration"``)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _no_dataset_below_integration(request, monkeypatch, tmp_path_factory) -> None:
    """Below the integration tier the data set is out of reach: a unit or component test that
    reads Fashion-MNIST fails (FileNotFoundError), whether the machine has it or not."""
    if request.node.path.parent.name in ("unit", "component"):
        monkeypatch.setenv("EVA0_FMNIST_ROOT", str(tmp_path_factory.getbasetemp() / "no-dataset"))
