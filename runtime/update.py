"""The update of one EVA-0-family step (Algorithm 1, lines 9-12), at the rates of the batch:
momentum, SGD step, anchor balancing, trust radius, relaxation toward the anchor, the moving
anchor, and the windowed centre and feature moments."""

from __future__ import annotations

import numpy as np

from .config import AdaptConfig
from .estimator import GradientEstimate
from .rates import statistics_window, step_rates, window_factor, windowed_update
from .state import AdaptState
from .stepcontrol import limit_step


def apply_update(config: AdaptConfig, state: AdaptState, est: GradientEstimate) -> bool:
    """Apply the SGD step, balancing, trust radius, relaxation and the windowed statistics,
    at the rates of this batch size; False (nothing written) if the new theta is not
    finite."""
    cfg, st = config, state
    batch = est.prediction.shape[0]
    rates = step_rates(cfg, batch, st.theta.size)
    theta = st.theta.astype(np.float64)
    anchor = st.anchor.astype(np.float64)
    velocity = (
        rates.momentum * st.velocity + (1.0 - rates.momentum) * est.grad
        if cfg.momentum else est.grad
    )
    delta = -rates.eta * velocity
    balance_in, balance_out = st.balance_in, st.balance_out
    if rates.balance_beta is not None:
        delta, balance_in, balance_out = balance(
            delta, anchor - theta, balance_in, balance_out, rates.balance_beta, cfg.eps
        )
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught just below
        delta, cut = limit_step(delta, rates.max_step_norm)
        new_theta = (1.0 - rates.gamma) * (theta + delta) + rates.gamma * anchor
        new_theta = new_theta.astype(np.float32)
    if not np.isfinite(new_theta).all():  # checked in float32, the dtype that is stored
        return False
    st.theta = new_theta
    st.velocity = np.asarray(velocity, dtype=np.float32)
    st.balance_in, st.balance_out = balance_in, balance_out
    st.clipped_steps += int(cut)
    if est.control is not None:
        st.clipped_coefs += est.control.clipped
        st.coef_scale, st.coef_weight = est.control.scale, est.control.weight
    if rates.anchor_follow is not None:
        follow = rates.anchor_follow
        st.anchor = (follow * new_theta.astype(np.float64) + (1.0 - follow) * anchor).astype(
            np.float32
        )
    update_statistics(config, state, est)
    return True


def update_statistics(config: AdaptConfig, state: AdaptState, est: GradientEstimate) -> None:
    """Centre and moments: windowed means over the last W samples, in stream order."""
    st = state
    factor = window_factor(statistics_window(config))
    weight = st.stat_weight
    st.center, _ = windowed_update(
        st.center, weight, est.prediction.astype(np.float64), factor
    )
    st.mean, _ = windowed_update(st.mean, weight, est.h_mean, factor)
    st.second_moment, st.stat_weight = windowed_update(
        st.second_moment, weight, est.h_sq, factor
    )


def balance(
    delta: np.ndarray,
    to_anchor: np.ndarray,
    a_in: float,
    a_out: float,
    beta: float,
    eps: float,
) -> tuple[np.ndarray, float, float]:
    """Paper appendix: damp the outward anchor-parallel part of the update when recent outward
    movement dominates inward movement. Returns (delta, a_in, a_out)."""
    e = to_anchor / (np.linalg.norm(to_anchor) + eps)
    c = float(delta @ e)
    a_in = beta * a_in + (1.0 - beta) * max(c, 0.0)
    a_out = beta * a_out + (1.0 - beta) * max(-c, 0.0)
    if c < 0:
        scale = min(1.0, a_in / (a_out + eps))
        delta = delta + (scale - 1.0) * c * e
    return delta, a_in, a_out
