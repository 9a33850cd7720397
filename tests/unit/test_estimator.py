"""The zeroth-order estimate, number by number, on a NumPy stand-in for the ORT session (a
small smooth model of theta): the served prediction, each coefficient, the gradient, the
one-sided and batch-shared variants, the objective's parts, the clipping and the prefetched
and regenerated perturbations. Fast: no ONNX file, no dataset."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from eva0_edge.runtime.config import AdaptConfig
from eva0_edge.runtime.estimator import Objective, ZerothOrderEstimator
from eva0_edge.runtime.losses import (
    sample_wise_alignment,
    shortcut_resistant_scores,
    softmax_entropy,
)
from eva0_edge.runtime.perturbation import PerturbationPlan, anchor_direction
from eva0_edge.runtime.state import AdaptState

F, K, D = 4, 3, 5  # features, classes, input width
P = F + K  # theta: a feature gain per feature, then a logit bias per class
PLAIN = {"shortcut_resistant": False, "center": False, "lambda_swa": 0.0, "coef_clip": None}


@dataclass
class Counter:
    forwards: int = 0
    samples: int = 0


@dataclass
class ToySession:
    """features = tanh(x A) * (1 + theta[:F]); logits = features W + theta[F:]. Row r of
    theta [R, P] runs on image r mod N (the estimator's layout: rows j * N + i)."""

    weights: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    counter: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.a = self.weights.normal(0, 1, (D, F))
        self.w = self.weights.normal(0, 1, (F, K))

    def forward(self, x: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-row (logits [R, K], features [R, F]), float64."""
        images = np.tile(x, (theta.shape[0] // x.shape[0], 1))
        features = np.tanh(images @ self.a) * (1.0 + theta[:, :F])
        return features @ self.w + theta[:, F:], features

    def run(self, x: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert theta.dtype == np.float32, "the graph's theta input is float32"
        self.counter.forwards += theta.shape[0]
        logits, features = self.forward(x, theta.astype(np.float64))
        return logits.astype(np.float32), features.astype(np.float32)

    def owned(self, array: np.ndarray) -> np.ndarray:
        return array.copy()


def _setup(overrides: dict | None = None, source_stats=None, batch: int = 6, seed: int = 1,
           prefetch: bool | None = None):
    """``prefetch`` None: the estimator's default."""
    config = AdaptConfig().updated({**PLAIN, **(overrides or {})})
    session = ToySession()
    asked = {} if prefetch is None else {"prefetch": prefetch}
    estimator = ZerothOrderEstimator(session, config, Objective(config, source_stats), **asked)
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (batch, D))
    state = AdaptState.initial(rng.normal(0, 0.1, P), K, F, seed=0)
    return config, session, estimator, x, state


def _z(seed: int, step: int, rows: int, n_anchor: int = 0, d_bar=None) -> np.ndarray:
    d_bar = np.zeros(P, dtype=np.float32) if d_bar is None else d_bar
    return PerturbationPlan.create(seed, step, rows, n_anchor, d_bar).draw()


def _rows(theta: np.ndarray, step: np.ndarray) -> np.ndarray:
    return (theta + step).astype(np.float32)


def _sides(session: ToySession, x: np.ndarray, theta: np.ndarray, step: np.ndarray, mu: float):
    """(logits at theta + step, at theta - step, the plain-entropy coefficients)."""
    plus, _ = session.run(x, _rows(theta, step))
    minus, _ = session.run(x, _rows(theta, -step))
    coef = (softmax_entropy(plus.astype(np.float64))
            - softmax_entropy(minus.astype(np.float64))) / (2 * mu)
    return plus, minus, coef


def test_prediction_coefficients_and_gradient_of_the_two_sided_estimate():
    config, session, estimator, x, state = _setup()
    state.center = np.array([0.5, -0.4, 0.2])  # not taken off: the config does not ask
    est = estimator.estimate(x, state, seed=3, step_index=5, n_anchor=0, control=False)
    z = _z(3, 5, 6)
    plus, minus, coef = _sides(session, x, state.theta, config.mu * z, config.mu)
    np.testing.assert_allclose(est.prediction, (plus + minus) / 2, rtol=1e-6)
    np.testing.assert_allclose(est.coef, coef, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(est.grad, coef @ z.astype(np.float64) / 6, rtol=1e-5, atol=1e-9)
    assert session.counter.samples == 6 and session.counter.forwards == 4 * 6  # 12 + our 12
    estimator.estimate(x, state, seed=3, step_index=6, n_anchor=0, control=False)
    assert session.counter.samples == 12 and session.counter.forwards == 6 * 6
    again = estimator.estimate(x, state, seed=3, step_index=6, n_anchor=0, control=False,
                               count=False)  # a batch counted when it was served
    assert session.counter.samples == 12 and session.counter.forwards == 8 * 6
    np.testing.assert_array_equal(again.grad, estimator.estimate(
        x, state, seed=3, step_index=6, n_anchor=0, control=False).grad)


def test_side_averaged_features_and_their_squares():
    config, session, estimator, x, state = _setup()
    est = estimator.estimate(x, state, seed=3, step_index=5, n_anchor=0, control=False)
    z = _z(3, 5, 6)
    _, h_plus = session.run(x, _rows(state.theta, config.mu * z))
    _, h_minus = session.run(x, _rows(state.theta, -config.mu * z))
    h_plus, h_minus = h_plus.astype(np.float64), h_minus.astype(np.float64)
    np.testing.assert_allclose(est.h_mean, (h_plus + h_minus) / 2, rtol=1e-6)
    np.testing.assert_allclose(est.h_sq, (h_plus**2 + h_minus**2) / 2, rtol=1e-6)


def test_one_sided_estimate_serves_the_unperturbed_rows():
    config, session, estimator, x, state = _setup({"two_sided": False})
    est = estimator.estimate(x, state, seed=2, step_index=0, n_anchor=0, control=False)
    z = _z(2, 0, 6)
    clean, h_clean = session.run(x, _rows(state.theta, 0 * z))
    moved, _ = session.run(x, _rows(state.theta, config.mu * z))
    np.testing.assert_allclose(est.prediction, clean, rtol=1e-6)
    np.testing.assert_allclose(est.h_sq, h_clean.astype(np.float64) ** 2, rtol=1e-6)
    coef = (softmax_entropy(moved.astype(np.float64))
            - softmax_entropy(clean.astype(np.float64))) / config.mu
    np.testing.assert_allclose(est.coef, coef, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("forwards", [2, 4])
def test_a_shared_perturbation_moves_every_sample_of_its_pair_alike(forwards):
    config, session, estimator, x, state = _setup({"sample_wise": False, "forwards": forwards})
    pairs = forwards // 2
    est = estimator.estimate(x, state, seed=4, step_index=1, n_anchor=0, control=False)
    z = _z(4, 1, pairs)
    step = np.repeat(config.mu * z, 6, axis=0)
    plus, minus, coef = _sides(session, x, state.theta, step, config.mu)
    np.testing.assert_allclose(est.prediction,
                               (plus + minus).reshape(pairs, 6, K).mean(axis=0) / 2, rtol=1e-6)
    np.testing.assert_allclose(est.coef, coef, rtol=1e-5, atol=1e-9)
    grad = coef.reshape(pairs, 6).mean(axis=1) @ z.astype(np.float64) / pairs
    np.testing.assert_allclose(est.grad, grad, rtol=1e-5, atol=1e-9)


def test_more_forwards_average_more_pairs_of_rows():
    config, session, estimator, x, state = _setup({"forwards": 4})
    est = estimator.estimate(x, state, seed=4, step_index=1, n_anchor=0, control=False)
    z = _z(4, 1, 12)
    plus, minus, coef = _sides(session, x, state.theta, config.mu * z, config.mu)
    np.testing.assert_allclose(est.prediction, (plus + minus).reshape(2, 6, K).mean(axis=0) / 2,
                               rtol=1e-6)
    np.testing.assert_allclose(est.grad, coef @ z.astype(np.float64) / 12, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("delta", [1e-8, 0.5])
def test_anchor_rows_follow_the_scaled_anchor_direction(delta):
    config, session, estimator, x, state = _setup({"delta": delta})
    state.anchor = state.theta + np.linspace(-0.2, 0.3, P).astype(np.float32)
    est = estimator.estimate(x, state, seed=6, step_index=2, n_anchor=2, control=False)
    d_bar = anchor_direction(state.theta, state.anchor, config.delta)
    z = _z(6, 2, 6, 2, d_bar)
    _, _, coef = _sides(session, x, state.theta, config.mu * z, config.mu)
    np.testing.assert_allclose(est.grad, coef @ z.astype(np.float64) / 6, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("eps", [1e-8, 0.05])
def test_the_objective_rescales_decentres_and_aligns(eps):
    """E_SR (each side rescaled to the served prediction's norm, the centre taken off) plus
    lambda l_SWA against the running moments (the batch's own before the first step), both
    with the configured eps."""
    source = (np.linspace(-1, 1, F), np.linspace(0.5, 1.5, F))
    config, session, estimator, x, state = _setup(
        {"shortcut_resistant": True, "center": True, "lambda_swa": 3.0, "rho": 0.9, "eps": eps},
        source)
    state.center = np.array([0.3, -0.2, 0.1])
    for ready in (False, True):
        if ready:
            state.stat_weight = 1.0
            state.mean, state.second_moment = np.full(F, 0.2), np.full(F, 0.5)
        est = estimator.estimate(x, state, seed=7, step_index=0, n_anchor=0, control=False)
        z = _z(7, 0, 6)
        sides = [session.run(x, _rows(state.theta, s * config.mu * z)) for s in (1, -1)]
        prediction = (sides[0][0] + sides[1][0]) / 2
        h = [f.astype(np.float64) for _, f in sides]
        moments = ((state.mean, state.second_moment) if ready else
                   (((h[0] + h[1]) / 2).mean(axis=0), ((h[0] ** 2 + h[1] ** 2) / 2).mean(axis=0)))
        ref = np.linalg.norm(prediction.astype(np.float64), axis=1)

        def loss(logits, features, ref=ref, moments=moments):
            scores = shortcut_resistant_scores(logits.astype(np.float64), ref, state.center, eps)
            return softmax_entropy(scores) + 3.0 * sample_wise_alignment(
                features, *moments, *source, 0.9, eps)

        coef = (loss(sides[0][0], h[0]) - loss(sides[1][0], h[1])) / (2 * config.mu)
        np.testing.assert_allclose(est.coef, coef, rtol=1e-5, atol=1e-9)


def test_alignment_without_source_statistics_is_refused():
    _, _, estimator, x, state = _setup({"lambda_swa": 1.0})
    with pytest.raises(ValueError, match="source statistics"):
        estimator.estimate(x, state, seed=0, step_index=0, n_anchor=0, control=False)


def test_coefficients_are_clipped_at_their_running_scale_only_under_control():
    config, _, estimator, x, state = _setup({"coef_clip": 2.0, "mu": 0.3})
    raw = estimator.estimate(x, state, seed=8, step_index=0, n_anchor=0, control=False)
    scale = float(np.median(np.abs(raw.coef)))
    state.coef_scale, state.coef_weight = scale / 4, 1.0
    clipped = estimator.estimate(x, state, seed=8, step_index=0, n_anchor=0, control=True)
    bound = 2.0 * scale / 4
    np.testing.assert_allclose(clipped.coef, np.clip(raw.coef, -bound, bound), rtol=1e-12)
    assert clipped.control is not None and clipped.control.clipped == int(
        (np.abs(raw.coef) > bound).sum()) > 0
    z = _z(8, 0, 6)
    np.testing.assert_allclose(clipped.grad, clipped.coef @ z.astype(np.float64) / 6, rtol=1e-9)
    assert raw.control is None


def test_a_one_sided_estimate_regenerated_in_chunks_gives_the_same_estimate():
    """Batch 20: the theta + mu z rows written three chunks of Z at a time."""
    stored = _setup({"two_sided": False}, batch=20)
    regenerated = _setup({"two_sided": False, "regenerate_z": True}, batch=20)
    estimates = [estimator.estimate(x, state, seed=5, step_index=1, n_anchor=0, control=False)
                 for _, _, estimator, x, state in (stored, regenerated)]
    np.testing.assert_allclose(estimates[1].coef, estimates[0].coef, rtol=1e-12)
    np.testing.assert_allclose(estimates[1].grad, estimates[0].grad, rtol=1e-12)


def test_a_shared_perturbation_regenerated_gives_the_same_estimate():
    stored, regenerated = _setup({"sample_wise": False}), _setup({"sample_wise": False,
                                                                 "regenerate_z": True})
    grads = [estimator.estimate(x, state, seed=2, step_index=3, n_anchor=0, control=False).grad
             for _, _, estimator, x, state in (stored, regenerated)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12)


def test_regenerated_and_prefetched_perturbations_give_the_same_estimate():
    """Batch 20: Z regenerated in three chunks of rows."""
    base, regen, prefetched = (_setup(batch=20), _setup({"regenerate_z": True}, batch=20),
                               _setup(prefetch=True, batch=20))
    for _, _, _, _, state in (base, regen, prefetched):
        state.anchor = state.theta + 0.1
    results = []
    for _, _, estimator, x, state in (base, regen, prefetched):
        results.append([estimator.estimate(x, state, seed=9, step_index=i, n_anchor=1,
                                           control=False).grad for i in range(3)])
    for other in results[1:]:
        np.testing.assert_allclose(np.array(other), np.array(results[0]), rtol=1e-6, atol=1e-12)
    assert prefetched[2].prefetch.hits == 2


def test_averaged_estimates_point_along_the_true_gradient():
    """Small mu, many steps: the mean estimate aligns with the finite-difference gradient of
    the batch's mean entropy; one step's estimate is noisy but positively aligned."""
    config, session, estimator, x, state = _setup({"mu": 1e-3}, batch=16)

    def mean_entropy(theta):
        logits, _ = session.forward(x, np.tile(theta, (16, 1)))
        return softmax_entropy(logits).mean()

    theta = state.theta.astype(np.float64)
    true = np.array([(mean_entropy(theta + 1e-6 * e) - mean_entropy(theta - 1e-6 * e)) / 2e-6
                     for e in np.eye(P)])
    estimates = np.array([estimator.estimate(x, state, seed=0, step_index=i, n_anchor=0,
                                             control=False).grad for i in range(400)])
    mean = estimates.mean(axis=0)
    assert mean @ true / (np.linalg.norm(mean) * np.linalg.norm(true)) > 0.95
    assert np.linalg.norm(mean) == pytest.approx(np.linalg.norm(true), rel=0.15)


def _prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("eva0-normals")}


@pytest.mark.parametrize("overrides,prefetch,drawn_ahead",
                         [({}, None, False), ({"regenerate_z": True}, True, False),
                          ({}, True, True)])
def test_rows_are_drawn_ahead_on_a_thread_only_when_asked_and_z_is_held(overrides, prefetch,
                                                                         drawn_ahead):
    """The default draws on the calling thread (on CPU ORT's threads hold every core); a
    regenerated Z is never drawn ahead (its point is not to hold Z)."""
    before = _prefetch_threads()
    _, _, estimator, x, state = _setup(overrides, prefetch=prefetch)
    for step in range(2):
        estimator.estimate(x, state, seed=1, step_index=step, n_anchor=0, control=False)
    assert len(_prefetch_threads() - before) == int(drawn_ahead)
