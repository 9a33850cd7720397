"""Bounded zeroth-order steps: robust clipping of the per-sample coefficients and a trust radius.

A sample's two-sided difference (l+_i - l-_i) / (2 mu) can be orders of magnitude above the
others (a near-tie in the entropy, lambda times l_SWA on one odd sample), and at small batches
one such coefficient is the whole step. Each |c_i| is clipped at ``coef_clip`` times a running
scale: the per-sample windowed mean (:func:`rates.windowed_update`) of the clipped |c|, over
``coef_window`` samples. With no history yet the batch's median |c| is the scale. Then the step
``delta theta`` is scaled down to the trust radius if it is longer (:mod:`rates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rates import window_factor, windowed_update


@dataclass(frozen=True)
class ClippedCoefficients:
    """coef [N] after clipping, how many were clipped, and the running scale to commit with the
    step (scale, weight)."""

    coef: np.ndarray
    clipped: int
    scale: float
    weight: float


def clip_coefficients(
    coef: np.ndarray, scale: float, weight: float, clip: float | None, window: float
) -> ClippedCoefficients:
    """Clip |coef_i| at ``clip`` x the running scale (``scale`` with total weight ``weight``,
    0 = no history) and update the scale with the clipped magnitudes. ``clip`` None: no
    clipping, the scale is still tracked."""
    magnitude = np.abs(coef)
    reference = scale if weight > 0 else float(np.median(magnitude))
    if clip is not None and reference > 0:
        bound = clip * reference
        clipped = int((magnitude > bound).sum())
        coef = np.clip(coef, -bound, bound)
    else:
        clipped = 0
    new_scale, new_weight = windowed_update(
        np.array([scale]), weight, np.abs(coef)[:, None], window_factor(window)
    )
    return ClippedCoefficients(coef, clipped, float(new_scale[0]), new_weight)


def limit_step(delta: np.ndarray, radius: float | None) -> tuple[np.ndarray, bool]:
    """``delta`` scaled to norm ``radius`` if longer (None: unbounded); (delta, was it cut)."""
    if radius is None or not np.isfinite(delta).all():
        return delta, False  # a non-finite step is the finiteness guard's to refuse
    peak = float(np.abs(delta).max(initial=0.0))
    norm = peak * float(np.linalg.norm(delta / peak)) if peak > 0 else 0.0  # no overflow
    if norm <= radius:
        return delta, False
    return delta * (radius / norm), True
