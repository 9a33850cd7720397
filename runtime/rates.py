"""Per-sample rates: the hyper-parameters mean the same at every batch size.

The paper's values are per step at a batch of 64. A device steps on whatever has arrived (a
server with one client steps on one image), so the engine quotes every rate per *reference
batch* of ``R`` samples (``AdaptConfig.reference_batch``, 64) and converts it to the batch ``B``
actually stepped, with ``f = B / R``:

* SGD step: ``eta_B = eta f``. The estimate is a mean over the batch, g_B = (1/B) sum_i c_i z_i,
  so eta_B g_B = (eta / R) sum_i c_i z_i: every sample moves theta by eta / R times its own term,
  whatever the batch. R samples in one batch of R or in R batches of 1 move theta by the same
  sum, with the same variance (to first order in eta).
* relaxation: a step keeps ``(1 - gamma)^f`` of its offset from the anchor, so R samples
  relax it by (1 - gamma) at any B.
* SGD momentum and the EMA of the balancing magnitudes: factor ``beta^f`` per step (beta per R
  samples). Momentum is the damped form v <- b v + (1 - b) g with the step eta_B / (1 - beta)
  v: at B = R it is exactly the paper's v <- beta v + g, step eta v, and at any B the steady
  state moves theta by eta g / (1 - beta) per R samples.
* moving anchor: the anchor keeps ``(1 - m_a)^f`` of itself per step.
* output centre and target moments: a per-sample exponential window of W samples (the
  statistic's variance equals that of a plain mean of W samples), updated sample by sample in
  stream order and bias-corrected (the statistic is the window-weighted mean of all samples seen
  so far, so it starts from the first samples instead of from zero). One batch of B or B batches
  of 1 give the same statistic. The paper's alpha (per batch of R) reads as
  ``W = R (1 + alpha) / (1 - alpha)``: alpha = 0.9 -> W = 1216 (a factor 0.9 per 64 samples, as
  the paper's EMA), alpha = 0 -> W = R = 64 (one reference batch, where the paper's value at
  B = 1 would be the scored sample itself).
* rho (l_SWA) and the anchor share are per sample already (rho: the weight of the history
  when one sample is added; k anchor-guided rows per 64 samples): unchanged.
* trust radius on ``||delta theta||``: ``trust_radius eta sqrt(P) sqrt(f)``. Zeroth-order steps
  are noise-dominated: the norm of a sum of B per-sample terms grows as sqrt(B) (measured on the
  shipped models: the median ||delta|| / sqrt(f) is within 1.5x from B = 1 to 64), so the
  radius binds the same share of steps at every batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepRates:
    """The per-step values for one batch (see the module docstring for the rules).

    eta: SGD step size (momentum-corrected). gamma: relaxation weight. momentum: factor of the
    damped velocity (0 = plain SGD). balance_beta: EMA factor of the balancing magnitudes
    (None = off). anchor_follow: weight of theta in the moving-anchor update (None = fixed
    anchor). max_step_norm: trust radius on ||delta theta|| (None = none).
    """

    eta: float
    gamma: float
    momentum: float
    balance_beta: float | None
    anchor_follow: float | None
    max_step_norm: float | None


def step_rates(config, batch: int, num_params: int) -> StepRates:
    """Convert ``config`` (an AdaptConfig, rates per reference batch) to a batch of ``batch``."""
    f = batch / config.reference_batch
    momentum = config.momentum**f if config.momentum else 0.0
    return StepRates(
        eta=config.eta * f / (1.0 - config.momentum),
        gamma=1.0 - (1.0 - config.gamma) ** f,
        momentum=momentum,
        balance_beta=None if config.balance_beta is None else config.balance_beta**f,
        anchor_follow=(
            None if config.moving_anchor is None else 1.0 - (1.0 - config.moving_anchor) ** f
        ),
        max_step_norm=(
            None if config.trust_radius is None
            else config.trust_radius * config.eta * np.sqrt(num_params * f)
        ),
    )


def statistics_window(config) -> float:
    """W in samples: ``config.stat_window``, else the paper's alpha read per reference batch."""
    if config.stat_window is not None:
        return float(config.stat_window)
    return config.reference_batch * (1.0 + config.alpha) / (1.0 - config.alpha)


def window_factor(window: float) -> float:
    """Per-sample EMA factor a = 1 - 2 / (W + 1) for a window of W >= 1 samples: an EMA with
    this factor has the variance of a plain mean of W samples."""
    return 1.0 - 2.0 / (window + 1.0)


def windowed_update(
    value: np.ndarray, weight: float, samples: np.ndarray, factor: float
) -> tuple[np.ndarray, float]:
    """Add ``samples`` [B, D] (in stream order) to a bias-corrected EMA.

    ``value`` [D]: the current statistic; ``weight``: its total weight 1 - a^n after n samples
    (0 = empty). Returns (new statistic [D], new weight). The result equals B updates by one
    sample each: m <- a m + (1 - a) h_i on the raw EMA, divided by 1 - a^(n + B).
    """
    batch = samples.shape[0]
    keep = factor**batch
    new_weight = 1.0 - keep * (1.0 - weight)
    if batch == 1:  # the same numbers without the powers (one image per request)
        raw = keep * weight * value + (1.0 - factor) * samples[0].astype(np.float64)
    else:
        powers = factor ** np.arange(batch - 1, -1, -1, dtype=np.float64)
        raw = keep * weight * value + (1.0 - factor) * (powers @ samples)
    return raw / new_weight, new_weight
