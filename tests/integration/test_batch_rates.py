"""Rates that mean the same at every batch size, bounded steps, and batch-1 safety on the
shipped models (issue: safe at any batch size)."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from eva0_edge.runtime.rates import (
    statistics_window,
    step_rates,
    window_factor,
    windowed_update,
)
from eva0_edge.runtime.state import AdaptState
from tests.fixtures import SHIPPED, uniform_batch


def test_engine_statistics_follow_the_window_rule(small_vit):
    model = Policy.load(small_vit.onnx_path, "eva0", {"eta": 0.0}, provider="cpu")
    logits = model.step(uniform_batch(6))
    factor = window_factor(statistics_window(model.config))
    expected, weight = windowed_update(np.zeros(logits.shape[1]), 0.0, logits, factor)
    np.testing.assert_allclose(model.state.center, expected, rtol=1e-5, atol=1e-6)
    assert model.state.stat_weight == pytest.approx(weight)


def _blow_up_one_side(model: Policy, monkeypatch) -> None:
    """From now on the first row of every ORT call (sample 0's + side) has absurd logits and
    features."""
    run = model.session.run

    def blown_up(x, rows):
        logits, features = run(x, rows)
        logits[0] = 0.0
        logits[0, 0] = 1e4
        features[0] *= 1e3
        return logits, features

    monkeypatch.setattr(model.session, "run", blown_up)


def test_engine_clips_a_blown_up_side_and_bounds_the_step(calibrated_vit, monkeypatch):
    """One sample's + side gets absurd logits: its coefficient is clipped and counted, and the
    step stays within the trust radius."""
    model = Policy.load(calibrated_vit, "eva0", {"eta": 0.01}, provider="cpu")
    for seed in range(4):
        model.step(uniform_batch(8, seed))
    _blow_up_one_side(model, monkeypatch)
    before = model.state.theta.copy()
    model.step(uniform_batch(8, 9))
    stats = model.stats()
    assert stats["clipped_coefficients"] >= 1 and stats["skipped_steps"] == 0
    radius = step_rates(model.config, 8, before.size).max_step_norm
    assert np.linalg.norm(model.state.theta - before) <= radius * 1.001


def test_a_step_longer_than_the_trust_radius_is_cut_to_it(calibrated_vit, monkeypatch):
    """No coefficient clipping, no relaxation, a blown-up side: the raw step is far longer than
    a trust radius of 0.001; theta moves by exactly the radius and the cut is counted."""
    config = {"eta": 0.01, "coef_clip": None, "gamma": 0.0, "trust_radius": 0.001,
              "anchor_per_64": 0.0}
    model = Policy.load(calibrated_vit, "eva0", config, provider="cpu")
    model.step(uniform_batch(8, 0))
    _blow_up_one_side(model, monkeypatch)
    before, cuts = model.state.theta.copy(), model.stats()["clipped_steps"]
    model.step(uniform_batch(8, 9))
    radius = step_rates(model.config, 8, before.size).max_step_norm
    assert model.stats()["clipped_steps"] == cuts + 1
    assert np.linalg.norm(model.state.theta - before) == pytest.approx(radius, rel=1e-3)


def test_version_one_state_dicts_still_load(calibrated_vit):
    model = Policy.load(calibrated_vit, "eva0", provider="cpu")
    model.step(uniform_batch(4))
    legacy = model.state_dict()
    for name in ("stat_weight", "coef_scale", "coef_weight", "clipped_coefs", "clipped_steps"):
        legacy.pop(name)
    legacy["moments_ready"] = True
    state = AdaptState.from_dict(legacy)
    assert state.stat_weight == 1.0 and state.coef_weight == 0.0 and state.moments_ready


def _clean_stream(path, count: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = load_fashion_mnist("test")
    order = np.random.default_rng(5).permutation(len(labels))[:count]
    return preprocess_uint8(images[order], read_metadata(path).preprocessing), labels[order]


@pytest.mark.integration  # Fashion-MNIST
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_batch_one_on_a_clean_stream_does_not_lose_to_noadapt(path):
    x, y = _clean_stream(path, 256)
    noadapt = Policy.load(path, "noadapt", provider="cpu", threads=1)
    reference = 100 * float((noadapt.predict(x).argmax(1) == y).mean())
    model = Policy.load(path, "eva0", provider="cpu", threads=1)
    hits = sum(int(model.step(x[i : i + 1]).argmax(1)[0] == y[i]) for i in range(len(y)))
    stats = model.stats()
    assert 100 * hits / len(y) >= reference - 1.0
    assert stats["skipped_steps"] == 0 and stats["drift"] < 5.0
