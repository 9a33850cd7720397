"""The input change detector on real Fashion-MNIST streams: silent on clean images, quick on a
return to clean after the sensor faults of the hostile sweep, the same at batch 1 and 64."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.runtime import inputwatch
from eva0_edge.runtime.inputwatch import RECENT_SAMPLES, InputChangeDetector, describe
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.fixtures import SHIPPED

PRE = read_metadata(SHIPPED[0]).preprocessing


def _images(name: str, start: int, stop: int) -> np.ndarray:
    images, _ = corrupted_fmnist("test", name, 1, 0, indices=np.arange(start, stop))
    return preprocess_uint8(images, PRE)


def _changes_at(x: np.ndarray, batch: int) -> list[int]:
    """The sample index after which each change was called, ``x`` fed ``batch`` at a time."""
    detector = InputChangeDetector()
    return [i + len(x[i:i + batch]) for i in range(0, len(x), batch)
            if detector.observe(x[i:i + batch])]


@pytest.mark.parametrize("batch", [1, 64])
def test_clean_images_call_no_change(batch):
    assert _changes_at(_images("clean", 0, 3000), batch) == []


@pytest.mark.parametrize("fault", ["gauss-0.2", "gauss-0.5", "blur-1", "blur-2", "jpeg-5"])
@pytest.mark.parametrize("batch", [1, 64])
def test_a_return_to_clean_after_a_sensor_fault_is_seen_at_once(fault, batch):
    """500 faulty images, then 500 clean ones: one change, within the first 64 clean images
    (at batch 64: the first batch all clean, after the one that straddles the return)."""
    x = np.concatenate([_images(fault, 0, 500), _images("clean", 500, 1000)])
    changes = _changes_at(x, batch)
    assert len(changes) == 1
    assert 500 < changes[0] <= 500 + max(64, 2 * batch)


@pytest.mark.parametrize("batch", [1, 64])
def test_a_mild_return_the_window_test_misses_is_called_by_the_cusum(batch, monkeypatch):
    """500 images with Gaussian noise of sigma 0.1, then 500 clean ones (issue 50 item 9's
    stream: the window test's largest z after the return is at its threshold): the CUSUM
    calls the return within 160 clean images; without it no change is called."""
    x = np.concatenate([_images("gauss-0.1", 0, 500), _images("clean", 500, 1000)])
    changes = _changes_at(x, batch)
    assert len(changes) == 1 and 500 < changes[0] <= 660
    monkeypatch.setattr(inputwatch, "CUSUM_H", math.inf)
    assert _changes_at(x, batch) == []


def test_descriptors_see_noise_contrast_and_blur_apart():
    """Noise raises the roughness, blur lowers it, a contrast change moves only the variance."""
    clean = _images("clean", 0, 256)
    rough = describe(_images("gauss-0.3", 0, 256)).mean(0) - describe(clean).mean(0)
    smooth = describe(_images("blur-2", 0, 256)).mean(0) - describe(clean).mean(0)
    faded = describe(clean * 0.5).mean(0) - describe(clean).mean(0)
    assert rough[2] > 0.5 and smooth[2] < -0.5
    assert faded[1] == pytest.approx(np.log(0.25), abs=1e-3) and abs(faded[2]) < 1e-3


def test_the_windows_restart_after_a_change():
    detector = InputChangeDetector()
    black = np.zeros((RECENT_SAMPLES * 2, *PRE.input_size), np.float32)
    for i in range(len(black)):
        detector.observe(black[i:i + 1])
    assert detector.observe(_images("clean", 0, 64)) and detector.changes == 1
    assert detector.long_weight == 0.0 and detector.recent_weight == 0.0


def _large(x: np.ndarray, seed: int | None = None, sigma: float = 0.0) -> np.ndarray:
    """One channel of 32 x 32 images enlarged 7x to 224 x 224 (nearest), plus pixel noise of
    ``sigma`` (normalised units) drawn at 224 x 224."""
    big = np.repeat(np.repeat(x[:, :1], 7, axis=2), 7, axis=3)
    if sigma:
        big = big + np.random.default_rng(seed).normal(0, sigma, big.shape).astype(np.float32)
    return big


def test_large_images_are_described_from_a_subgrid_that_estimates_the_whole():
    """224 x 224: stride 7, a 32 x 32 subgrid; its descriptors follow the full image's (the
    brightness and contrast within sampling error, the roughness's order kept); 32 x 32: the
    full image (float32 sums: within 2e-5 of float64 ones)."""
    from eva0_edge.runtime.inputwatch import GRID

    small = _images("clean", 0, 64)
    axes = (1, 2, 3)
    f64 = np.float64
    full_edges = (np.diff(small, axis=3) ** 2).mean(axes, dtype=f64) + \
        (np.diff(small, axis=2) ** 2).mean(axes, dtype=f64)
    variance = small.var(axes, dtype=f64)
    full = np.stack([small.mean(axes, dtype=f64), np.log(variance + 1e-6),
                     np.log((full_edges + 1e-6) / (variance + 1e-6))], axis=1)
    np.testing.assert_allclose(describe(small), full, rtol=0, atol=2e-5)
    assert small.shape[2] == GRID
    clean, noisy = describe(_large(small)), describe(_large(small, 0, 0.5))
    np.testing.assert_allclose(clean[:, 0], small[:, :1].mean(axis=axes), atol=0.1)
    assert (noisy[:, 2] > clean[:, 2] + 0.5).all()


@pytest.mark.parametrize("batch", [1, 64])
def test_large_images_a_return_to_clean_is_seen_and_clean_calls_none(batch):
    """The same detector on 224 x 224 inputs: 384 noisy images (sigma 0.5 at 224 px) then 384
    clean ones: one change, within the first 64 clean images."""
    clean, later = _images("clean", 0, 384), _images("clean", 384, 768)
    x = np.concatenate([_large(clean, 1, 0.5), _large(later)])
    assert _changes_at(_large(clean), batch) == []
    changes = _changes_at(x, batch)
    assert len(changes) == 1 and 384 < changes[0] <= 384 + max(64, 2 * batch)


def test_large_images_read_only_the_sampled_rows():
    """Of a 224 x 224 image only every 7th row and the row under it are read (NaN elsewhere
    leaves the descriptors finite): the cost is 2/7 of the image."""
    x = _large(_images("clean", 0, 4))
    x[:, :, np.arange(224) % 7 > 1] = np.nan
    assert np.isfinite(describe(x)).all()
