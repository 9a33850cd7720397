"""The health guard: watches cheap signals of the adaptation and rolls back when they leave the
range healthy adaptation showed on the validation streams.

Signals, each a windowed mean over the last ``guard_window`` samples (:mod:`rates`), all free
(computed from what a step already has):

* ``entropy``: mean prediction entropy / ln K (over-confident collapse: too low; a model
  turned to noise predicts near-uniformly: too high);
* ``spread``: entropy of the windowed share of each predicted class (argmax) / ln K (collapse
  to a few classes: too low);
* ``logit_norm``: mean logit norm (a runaway scale: too high; a washed-out model: too low);
* ``drift``: ||theta - theta0|| (too high);
* ``alignment``: the l_SWA distance of the online feature moments to the source statistics, per
  feature (too high; only for files with source statistics).

A signal is checked once ``guard_warmup`` samples are in (the window's mean is bias-corrected,
so a part-filled window is the mean of the samples seen). On a trip the engine rolls
theta back to the last healthy checkpoint (taken every ``guard_checkpoint`` healthy samples), or
to theta0 when the first check after the previous rollback trips again (that checkpoint is
unhealthy too), resets the online statistics, and pauses adaptation (predictions only) for
``guard_pause`` samples (the engine keeps that count in the state). Bounds come from the model
file's recommended values (learnt on the validation split by ``models/guard_bounds.py``) or the
generic defaults of ``AdaptConfig.guard_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .losses import softmax_entropy
from .rates import window_factor, windowed_update

SIGNALS = ("entropy", "spread", "logit_norm", "drift", "alignment")


@dataclass(frozen=True)
class GuardBounds:
    """Where a signal trips: below a ``*_min`` or above a ``*_max`` (None = not checked). The
    defaults live in ``AdaptConfig`` as ``guard_<field>``."""

    entropy_min: float | None
    entropy_max: float | None
    spread_min: float | None
    logit_norm_min: float | None
    logit_norm_max: float | None
    drift_max: float | None
    alignment_max: float | None

    def violation(self, values: dict[str, float | None]) -> str | None:
        """The first broken bound as a readable reason, or None."""
        for name, value in values.items():
            if value is None:
                continue
            low = getattr(self, f"{name}_min", None)
            high = getattr(self, f"{name}_max", None)
            if low is not None and value < low:
                return f"{name} {value:.4g} below its bound {low:.4g}"
            if high is not None and value > high:
                return f"{name} {value:.4g} above its bound {high:.4g}"
        return None


@dataclass
class SignalWindows:
    """Windowed means of the per-sample signals and of the predicted-class shares [K]."""

    factor: float
    entropy: float = 0.0
    logit_norm: float = 0.0
    shares: np.ndarray = field(default_factory=lambda: np.zeros(0))
    weight: float = 0.0
    samples: int = 0

    def add(self, logits: np.ndarray) -> None:
        """Add a batch of predictions (logits [B, K], stream order)."""
        scores = logits.astype(np.float64)
        k = scores.shape[1]
        per_sample = np.column_stack([
            softmax_entropy(scores) / np.log(k), np.linalg.norm(scores, axis=1),
            np.eye(k)[scores.argmax(axis=1)],
        ])
        if self.shares.size != k:
            self.shares = np.zeros(k)
        current = np.concatenate([[self.entropy, self.logit_norm], self.shares])
        value, self.weight = windowed_update(current, self.weight, per_sample, self.factor)
        self.entropy, self.logit_norm, self.shares = value[0], value[1], value[2:]
        self.samples += logits.shape[0]

    def spread(self) -> float:
        p = np.clip(self.shares, 1e-12, None)
        return float(-(p * np.log(p)).sum() / np.log(p.size))


class HealthGuard:
    """Keeps the signal windows, the last healthy checkpoint and the trip counts of one model.

    ``window``, ``warmup`` and ``checkpoint_every`` are in samples.
    """

    def __init__(
        self, bounds: GuardBounds, window: float, warmup: int, checkpoint_every: int
    ) -> None:
        self.bounds = bounds
        self.window = window
        self.warmup = warmup
        self.checkpoint_every = checkpoint_every
        self.windows = SignalWindows(window_factor(window))
        self.since_checkpoint = 0
        self.since_rollback: int | None = None
        self.last_reason: str | None = None

    def restart_windows(self) -> None:
        self.windows = SignalWindows(window_factor(self.window))

    def observe(
        self, logits: np.ndarray, drift: float, alignment: float | None
    ) -> tuple[str | None, bool]:
        """Add a step's predictions and the current drift / feature distance. Returns (the
        reason of a trip or None, whether a healthy checkpoint is due now)."""
        self.windows.add(logits)
        batch = logits.shape[0]
        if self.since_rollback is not None:
            self.since_rollback += batch
        if self.windows.samples < self.warmup:
            return None, False
        reason = self.bounds.violation(self.values(drift, alignment))
        if reason is not None:
            return reason, False
        self.since_checkpoint += batch
        if self.since_checkpoint >= self.checkpoint_every:
            self.since_checkpoint = 0
            return None, True
        return None, False

    def values(self, drift: float, alignment: float | None) -> dict[str, float | None]:
        """The current signal values (None before any sample)."""
        if not self.windows.samples:
            return dict.fromkeys(SIGNALS)
        return {
            "entropy": self.windows.entropy, "spread": self.windows.spread(),
            "logit_norm": self.windows.logit_norm, "drift": drift, "alignment": alignment,
        }

    def tripped(self, reason: str) -> bool:
        """Record a trip; True when the rollback should go to theta0 (the previous rollback
        was less than one window ago, so its checkpoint is unhealthy too)."""
        to_source = (
            self.since_rollback is not None and self.since_rollback < self.warmup + self.window
        )
        self.since_rollback = 0
        self.since_checkpoint = 0
        self.last_reason = reason
        self.restart_windows()
        return to_source


def alignment_distance(
    mean: np.ndarray, second_moment: np.ndarray, source_mean: np.ndarray, source_std: np.ndarray
) -> float:
    """(||m - m_s||^2 + ||sigma - sigma_s||^2) / F of the online moments [F] against the source."""
    sigma = np.sqrt(np.maximum(second_moment - mean * mean, 0.0))
    return float((((mean - source_mean) ** 2).sum() + ((sigma - source_std) ** 2).sum())
                 / mean.size)
