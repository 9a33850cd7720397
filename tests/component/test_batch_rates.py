"""Rates that mean the same at every batch size, bounded steps, and batch-1 safety on the
shipped models (issue: safe at any batch size)."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.config import AdaptConfig
from eva0_edge.runtime.rates import (
    statistics_window,
    step_rates,
    window_factor,
    windowed_update,
)
from eva0_edge.runtime.stepcontrol import clip_coefficients, limit_step


def test_one_batch_of_b_equals_b_batches_of_one():
    """The windowed statistics depend on the samples and their order, not on the batching."""
    samples = np.random.default_rng(0).normal(size=(24, 5))
    factor = window_factor(64.0)
    whole, whole_weight = windowed_update(np.zeros(5), 0.0, samples, factor)
    value, weight = np.zeros(5), 0.0
    for row in samples:
        value, weight = windowed_update(value, weight, row[None, :], factor)
    np.testing.assert_allclose(value, whole, rtol=1e-12)
    assert weight == pytest.approx(whole_weight, rel=1e-12)
    halves = windowed_update(*windowed_update(np.zeros(5), 0.0, samples[:10], factor),
                             samples[10:], factor)
    np.testing.assert_allclose(halves[0], whole, rtol=1e-12)


def test_window_statistics_start_from_the_first_samples_and_forget_old_ones():
    factor = window_factor(64.0)
    value, weight = windowed_update(np.zeros(1), 0.0, np.full((3, 1), 7.0), factor)
    assert value[0] == pytest.approx(7.0)  # bias-corrected: no pull toward the zero start
    value, weight = windowed_update(value, weight, np.zeros((640, 1)), factor)
    assert value[0] < 7.0 * 1e-7  # ten windows later the old samples are gone


def test_paper_alpha_reads_as_a_window_that_matches_it_at_batch_64():
    config = AdaptConfig(alpha=0.9)
    assert statistics_window(config) == pytest.approx(64 * 1.9 / 0.1)
    assert window_factor(statistics_window(config)) ** 64 == pytest.approx(0.9, abs=1e-3)
    assert statistics_window(AdaptConfig(alpha=0.0)) == 64  # not the scored sample itself
    assert statistics_window(AdaptConfig(alpha=0.0, stat_window=500)) == 500


def test_step_rates_are_the_paper_values_at_64_and_per_sample_below():
    config = AdaptConfig(eta=0.01, gamma=0.01, momentum=0.9, balance_beta=0.8,
                         moving_anchor=0.1, trust_radius=10.0)
    at_64 = step_rates(config, 64, 100)
    assert at_64.eta == pytest.approx(0.01 / 0.1)  # damped momentum: eta / (1 - beta) x v
    assert (at_64.gamma, at_64.momentum, at_64.balance_beta, at_64.anchor_follow) == (
        pytest.approx(0.01), pytest.approx(0.9), pytest.approx(0.8), pytest.approx(0.1))
    at_1 = step_rates(config, 1, 100)
    assert at_1.eta == pytest.approx(at_64.eta / 64)
    assert (1 - at_1.gamma) ** 64 == pytest.approx(1 - 0.01)
    assert at_1.momentum**64 == pytest.approx(0.9)
    assert (1 - at_1.anchor_follow) ** 64 == pytest.approx(0.9)
    assert at_64.max_step_norm == pytest.approx(10 * 0.01 * np.sqrt(100))
    assert at_1.max_step_norm == pytest.approx(at_64.max_step_norm / 8)


def test_an_injected_huge_coefficient_is_clipped_and_counted():
    history = clip_coefficients(np.ones(64), 0.0, 0.0, 5.0, 256.0)
    assert history.clipped == 0 and history.scale == pytest.approx(1.0)
    coef = np.array([1.0, -1.0, 1e9, -1e9])
    out = clip_coefficients(coef, history.scale, history.weight, 5.0, 256.0)
    assert out.clipped == 2
    np.testing.assert_allclose(out.coef, [1.0, -1.0, 5.0, -5.0])
    assert out.scale < 1.2  # the outliers enter the scale clipped (at 5, not 1e9)
    none = clip_coefficients(coef, history.scale, history.weight, None, 256.0)
    assert none.clipped == 0 and none.coef[2] == 1e9
    delta, cut = limit_step(np.array([3.0, 4.0]), 1.0)
    assert cut and np.linalg.norm(delta) == pytest.approx(1.0)
    assert limit_step(np.array([0.3, 0.4]), 1.0) == (pytest.approx([0.3, 0.4]), False)


def test_the_clip_bound_is_clip_times_the_scale_or_the_first_batchs_median():
    first = clip_coefficients(np.array([1.0, -1.0, 2.0, -100.0]), 0.0, 0.0, 5.0, 256.0)
    np.testing.assert_allclose(first.coef, [1.0, -1.0, 2.0, -7.5])  # 5 x median |c| (1.5)
    later = clip_coefficients(np.array([3.0, -9.0, 10.0, 11.0]), 2.0, 1.0, 5.0, 256.0)
    np.testing.assert_allclose(later.coef, [3.0, -9.0, 10.0, 10.0])  # bound 5 x 2 = 10
    assert later.clipped == 1  # 10.0 sits on the bound: not clipped
    zeros = clip_coefficients(np.array([1.0, -2.0]), 0.0, 1.0, 5.0, 256.0)
    np.testing.assert_allclose(zeros.coef, [1.0, -2.0])  # a scale of 0: nothing to clip at


def test_the_trust_radius_cuts_only_steps_longer_than_it():
    small, cut = limit_step(np.array([0.03, 0.04]), 0.01)
    assert cut and np.linalg.norm(small) == pytest.approx(0.01)
    on_it, cut = limit_step(np.array([3.0, 4.0]), 5.0)
    assert not cut and np.array_equal(on_it, [3.0, 4.0])  # a step of the radius itself
    for delta in (np.zeros(3), np.array([])):
        same, cut = limit_step(delta, 0.5)
        assert not cut and np.array_equal(same, delta)
    unbounded = np.array([3e3, 4e3])
    assert limit_step(unbounded, None)[1] is False
    broken = np.array([np.nan, 1e9])
    kept, cut = limit_step(broken, 1.0)
    assert kept is broken and cut is False  # the finiteness guard refuses it, not this
