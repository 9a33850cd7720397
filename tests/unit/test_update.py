"""The update of one step and the per-sample rates, number by number on made-up estimates:
SGD with and without momentum, relaxation toward the anchor, the trust radius, balancing, the
moving anchor, the counters, the windowed statistics and the refusal of a non-finite theta.
Fast: no model."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.config import AdaptConfig
from eva0_edge.runtime.estimator import GradientEstimate
from eva0_edge.runtime.rates import (
    statistics_window,
    step_rates,
    window_factor,
    windowed_update,
)
from eva0_edge.runtime.state import AdaptState
from eva0_edge.runtime.stepcontrol import ClippedCoefficients
from eva0_edge.runtime.update import apply_update, balance

P, K, F = 4, 3, 2
OFF = {"trust_radius": None, "gamma": 0.0, "momentum": 0.0, "balance_beta": None,
       "moving_anchor": None, "stat_window": 64.0}


def _state() -> AdaptState:
    state = AdaptState.initial(np.array([0.5, -0.5, 1.0, 0.0]), K, F, seed=0)
    state.anchor = np.array([1.0, 0.0, 1.0, 0.0], dtype=np.float32)
    return state


def _estimate(batch: int = 16, grad=(1.0, -2.0, 0.5, 0.0), control=None) -> GradientEstimate:
    rng = np.random.default_rng(batch)
    return GradientEstimate(
        prediction=rng.normal(0, 1, (batch, K)).astype(np.float32),
        grad=np.array(grad, dtype=np.float64), coef=np.zeros(batch),
        h_mean=rng.normal(0, 1, (batch, F)), h_sq=rng.uniform(1, 2, (batch, F)),
        control=control)


def _config(**given) -> AdaptConfig:
    return AdaptConfig().updated({**OFF, "eta": 0.1, **given})


def test_the_sgd_step_is_eta_times_the_batch_share_of_the_reference_batch():
    state, est = _state(), _estimate(batch=16)
    theta = state.theta.astype(np.float64)
    assert apply_update(_config(), state, est)
    np.testing.assert_allclose(state.theta, theta - 0.1 * (16 / 64) * est.grad, rtol=1e-6)
    np.testing.assert_allclose(state.velocity, est.grad, rtol=1e-6)
    np.testing.assert_array_equal(state.anchor, _state().anchor)  # a fixed anchor stays


def test_relaxation_keeps_one_minus_gamma_to_the_batch_share_of_the_offset():
    state, est = _state(), _estimate(batch=32, grad=(0, 0, 0, 0))
    theta, anchor = state.theta.astype(np.float64), state.anchor.astype(np.float64)
    assert apply_update(_config(gamma=0.2), state, est)
    keep = (1 - 0.2) ** 0.5
    np.testing.assert_allclose(state.theta, keep * theta + (1 - keep) * anchor, rtol=1e-6)


def test_momentum_is_the_damped_velocity_with_the_corrected_step():
    state, est = _state(), _estimate(batch=64)
    state.velocity = np.array([2.0, 0.0, 0.0, -1.0], dtype=np.float32)
    theta = state.theta.astype(np.float64)
    assert apply_update(_config(momentum=0.5), state, est)
    velocity = 0.5 * np.array([2.0, 0.0, 0.0, -1.0]) + 0.5 * est.grad
    np.testing.assert_allclose(state.velocity, velocity, rtol=1e-6)
    np.testing.assert_allclose(state.theta, theta - (0.1 / 0.5) * velocity, rtol=1e-6)


def test_the_trust_radius_cuts_the_step_and_counts_it():
    state, est = _state(), _estimate(batch=64, grad=(100.0, 0.0, 0.0, 0.0))
    theta = state.theta.astype(np.float64)
    assert apply_update(_config(trust_radius=0.5), state, est)
    radius = 0.5 * 0.1 * np.sqrt(P)
    np.testing.assert_allclose(np.linalg.norm(state.theta - theta), radius, rtol=1e-6)
    assert state.clipped_steps == 1
    assert apply_update(_config(trust_radius=0.5), state, _estimate(batch=64, grad=(0.1,) * 4))
    assert state.clipped_steps == 1


def test_the_coefficient_clipping_is_committed_with_the_step():
    control = ClippedCoefficients(np.zeros(16), clipped=3, scale=0.7, weight=0.25)
    state = _state()
    assert apply_update(_config(), state, _estimate(control=control))
    assert (state.clipped_coefs, state.coef_scale, state.coef_weight) == (3, 0.7, 0.25)
    control = ClippedCoefficients(np.zeros(16), clipped=2, scale=0.5, weight=0.5)
    assert apply_update(_config(), state, _estimate(control=control))
    assert (state.clipped_coefs, state.coef_scale, state.coef_weight) == (5, 0.5, 0.5)


def test_the_stored_vectors_stay_float32():
    state = _state()
    assert apply_update(_config(momentum=0.5, moving_anchor=0.5), state, _estimate())
    assert state.theta.dtype == state.velocity.dtype == state.anchor.dtype == np.float32


def test_the_moving_anchor_follows_theta_at_its_batch_rate():
    state, est = _state(), _estimate(batch=16)
    anchor = state.anchor.astype(np.float64)
    assert apply_update(_config(moving_anchor=0.5), state, est)
    follow = 1 - 0.5 ** (16 / 64)
    np.testing.assert_allclose(state.anchor, follow * state.theta + (1 - follow) * anchor,
                               rtol=1e-6)


def test_balancing_damps_only_the_outward_anchor_part_when_outward_dominates():
    to_anchor = np.array([2.0, 0.0])
    inward, a_in, a_out = balance(np.array([1.0, 1.0]), to_anchor, 0.0, 0.0, 0.5, 1e-12)
    np.testing.assert_allclose(inward, [1.0, 1.0])  # moving toward the anchor: untouched
    assert (a_in, a_out) == (pytest.approx(0.5), 0.0)
    outward, a_in, a_out = balance(np.array([-3.0, 1.0]), to_anchor, a_in, a_out, 0.5, 1e-12)
    assert (a_in, a_out) == (pytest.approx(0.25), pytest.approx(1.5))
    np.testing.assert_allclose(outward, [-3.0 * 0.25 / 1.5, 1.0], rtol=1e-9)
    state, est = _state(), _estimate(batch=64, grad=(1.0, 2.0, 0.5, 3.0))  # outward
    state.balance_in, state.balance_out = 0.1, 2.0
    theta, anchor = state.theta.astype(np.float64), state.anchor.astype(np.float64)
    assert apply_update(_config(balance_beta=0.5), state, est)
    delta, a_in, a_out = balance(-0.1 * est.grad, anchor - theta, 0.1, 2.0, 0.5, 1e-8)
    assert not np.allclose(delta, -0.1 * est.grad)  # this step is damped
    np.testing.assert_allclose(state.theta, theta + delta, rtol=1e-6)
    assert (state.balance_in, state.balance_out) == (pytest.approx(a_in), pytest.approx(a_out))


def test_statistics_are_windowed_means_of_the_served_prediction_and_features():
    state, est = _state(), _estimate(batch=8)
    assert apply_update(_config(stat_window=16.0), state, est)
    a = window_factor(16.0)
    center, weight = windowed_update(np.zeros(K), 0.0, est.prediction.astype(np.float64), a)
    np.testing.assert_allclose(state.center, center, rtol=1e-12)
    np.testing.assert_allclose(state.mean, windowed_update(np.zeros(F), 0.0, est.h_mean, a)[0])
    np.testing.assert_allclose(state.second_moment,
                               windowed_update(np.zeros(F), 0.0, est.h_sq, a)[0])
    assert state.stat_weight == pytest.approx(weight)


@pytest.mark.parametrize("grad,given", [
    ((np.inf, 0.0, 0.0, 0.0), {}),
    ((np.inf, 0.0, 0.0, 0.0), {"trust_radius": 0.5}),
    ((np.inf, 0.0, 0.0, 0.0), {"gamma": 1.0}),  # all the way to the anchor: 0 x inf, invalid
    ((1e300, 1e300, 0.0, 0.0), {}),  # finite in float64, beyond float32: overflow
])
def test_a_non_finite_theta_writes_nothing_and_warns_nothing(grad, given):
    """Refused quietly (the caller counts the skip): no numpy warning on the device's log."""
    import warnings

    state = _state()
    before = state.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not apply_update(_config(**given), state, _estimate(grad=grad))
    after = state.to_dict()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)


def test_rates_at_the_reference_batch_and_at_others():
    cfg = AdaptConfig().updated({"eta": 0.2, "gamma": 0.1, "momentum": 0.5, "balance_beta": 0.9,
                                 "moving_anchor": 0.3, "trust_radius": 2.0})
    at_r = step_rates(cfg, 64, 100)
    assert (at_r.eta, at_r.gamma, at_r.momentum, at_r.balance_beta) == (
        pytest.approx(0.4), pytest.approx(0.1), pytest.approx(0.5), pytest.approx(0.9))
    assert at_r.anchor_follow == pytest.approx(0.3)
    assert at_r.max_step_norm == pytest.approx(2.0 * 0.2 * 10.0)
    at_16 = step_rates(cfg, 16, 100)
    assert at_16.eta == pytest.approx(0.1)
    assert at_16.gamma == pytest.approx(1 - 0.9**0.25)
    assert at_16.momentum == pytest.approx(0.5**0.25)
    assert at_16.balance_beta == pytest.approx(0.9**0.25)
    assert at_16.anchor_follow == pytest.approx(1 - 0.7**0.25)
    assert at_16.max_step_norm == pytest.approx(2.0 * 0.2 * np.sqrt(25.0))
    plain = step_rates(AdaptConfig().updated({"momentum": 0.0, "trust_radius": None,
                                              "balance_beta": None, "moving_anchor": None}),
                       64, 100)
    assert plain.momentum == 0.0 and plain.max_step_norm is None
    assert plain.balance_beta is None and plain.anchor_follow is None


def test_the_statistics_window_and_its_factor():
    assert statistics_window(AdaptConfig().updated({"stat_window": 300.0})) == 300.0
    assert statistics_window(AdaptConfig().updated({"alpha": 0.9})) == pytest.approx(1216.0)
    assert statistics_window(AdaptConfig().updated({"alpha": 0.0})) == pytest.approx(64.0)
    assert window_factor(1.0) == 0.0 and window_factor(3.0) == pytest.approx(0.5)


def test_a_windowed_update_of_a_batch_is_its_samples_one_by_one():
    rng = np.random.default_rng(0)
    samples = rng.normal(0, 1, (5, 3))
    value, weight = np.zeros(3), 0.0
    for row in samples:
        value, weight = windowed_update(value, weight, row[None], 0.7)
    batched, batched_weight = windowed_update(np.zeros(3), 0.0, samples, 0.7)
    np.testing.assert_allclose(batched, value, rtol=1e-12)
    assert batched_weight == pytest.approx(weight) == pytest.approx(1 - 0.7**5)
    raw = sum(0.3 * 0.7 ** (4 - i) * samples[i] for i in range(5))
    np.testing.assert_allclose(batched, raw / (1 - 0.7**5), rtol=1e-12)


def test_balancing_at_its_edges():
    """eps counts (a visible eps here), a small inward move is never damped, an outward move
    while inward movement dominates is not amplified."""
    e = np.array([1.0, 0.0])
    small_in, a_in, a_out = balance(np.array([0.5, 1.0]), 2 * e, 0.0, 0.0, 0.5, 1e-12)
    np.testing.assert_allclose(small_in, [0.5, 1.0])
    inward, _, _ = balance(np.array([0.5, 1.0]), 2 * e, 0.0, 4.0, 0.5, 1e-12)
    np.testing.assert_allclose(inward, [0.5, 1.0])  # outward dominates, but this moves in
    out, a_in, a_out = balance(np.array([-0.1, 1.0]), 2 * e, 4.0, 0.0, 0.5, 1e-12)
    np.testing.assert_allclose(out, [-0.1, 1.0])  # a_in 2 > a_out 0.05: scale capped at 1
    damped, _, _ = balance(np.array([-1.0, 0.0]), np.array([3.0, 0.0]), 1.0, 1.0, 0.5, 1.0)
    # e = (3, 0) / (3 + 1); c = -0.75; a_in = 0.5, a_out = 0.875; scale = 0.5 / 1.875
    c, e = -0.75, np.array([0.75, 0.0])
    np.testing.assert_allclose(damped, [-1.0 + (0.5 / 1.875 - 1.0) * c * e[0], 0.0])
