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
unhealthy too), resets the online statistics, and pauses adaptation for ``guard_pause``
samples (the engine keeps that count in the state).

The pause is a duel, at the two forwards per sample an adaptation step costs: each batch runs
at the checkpoint and at theta0 in one call, theta0's predictions are served, and each side's
prediction signals (entropy, spread, logit norm) and feature moments (the alignment) fill their
own windows. At the end of the pause (:meth:`HealthGuard.pause_verdict`), when theta0's own
signals are out of bounds it holds at theta0 for another pause: a stream on which even the
source model's signals are out of bounds (black frames, a corruption that collapses the
source to one class) carries nothing the guard can vouch for, whatever the candidate's
signals say, so the device serves the source model until the signals come back. Otherwise
adaptation resumes from the checkpoint if its signals are in bounds (and it passes the
audit's test below), else from theta0. A pause at theta0 (after a second trip) has no duel:
one forward per sample.

Absolute bounds cannot see a theta that is healthy by every signal but wrong for the stream it
now meets (a continual stream leaves a theta adapted to one corruption in front of the next).
An audit every ``guard_audit`` adapted samples is the same duel, serving the current theta:
the current theta is kept only if it is in bounds and its features are at most ``margin``
(``guard_audit_margin``) times as far from the source statistics as theta0's on the same
images (the alignment term EVA-0 itself minimises); otherwise theta0 wins. An audit lasts
``guard_warmup`` samples. Trip pauses apply the same test to the checkpoint.

A change of stream (seen in the input images, :mod:`.inputwatch`, or by the activation
shift's detector) starts an audit at once, whatever ``guard_audit``. It serves theta0, not the
current theta, and the current theta is kept only within ``guard_change_margin`` (1) times
theta0's feature distance: what was learnt on the old stream must show it is at least as
close to the source on the new one (the ViT adapted to Gaussian noise of sigma 0.2 was 1.9x
theta0's distance on the clean images that followed and served them 2.6 points under NoAdapt).
When theta0 fails on the new stream too (a hold), the engine goes back to the last healthy
checkpoint: the current theta's last steps were taken on that stream.

Bounds come from the model file's recommended values (learnt on the validation split by
``models/recipes/guard_bounds.py``; the audit interval by ``models/recipes/guard_audit.py``) or
the generic defaults of ``AdaptConfig.guard_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .losses import softmax_entropy
from .rates import window_factor, windowed_update

SIGNALS = ("entropy", "spread", "logit_norm", "drift", "alignment")
VERDICTS = ("checkpoint", "theta0", "hold")


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


@dataclass
class FeatureWindow:
    """Windowed mean and second moment [F] of the features of one side of a pause."""

    factor: float
    moments: np.ndarray = field(default_factory=lambda: np.zeros(0))
    weight: float = 0.0

    def add(self, features: np.ndarray) -> None:
        """Add the features [B, F] of a batch (stream order)."""
        h = features.astype(np.float64)
        if self.moments.size != 2 * h.shape[1]:  # the first batch (or another width): restart
            self.moments, self.weight = np.zeros(2 * h.shape[1]), 0.0
        self.moments, self.weight = windowed_update(
            self.moments, self.weight, np.hstack([h, h * h]), self.factor
        )

    def distance(self, source_stats: tuple[np.ndarray, np.ndarray]) -> float | None:
        """The l_SWA distance of the window's moments to the source (None when empty)."""
        if not self.weight:
            return None
        mean, second = np.split(self.moments, 2)
        return alignment_distance(mean, second, *source_stats)


class HealthGuard:
    """Keeps the signal windows, the last healthy checkpoint and the trip counts of one model.

    ``window``, ``warmup`` and ``checkpoint_every`` are in samples.
    """

    def __init__(
        self, bounds: GuardBounds, window: float, warmup: int, checkpoint_every: int,
        source_stats: tuple[np.ndarray, np.ndarray] | None = None, margin: float = 2.0,
        change_margin: float = 1.0,
    ) -> None:
        self.bounds = bounds
        self.margin = margin
        self.change_margin = change_margin
        self.source_stats = source_stats
        self.window = window
        self.warmup = warmup
        self.checkpoint_every = checkpoint_every
        self.restart_windows()
        self.since_checkpoint = 0
        self.since_rollback: int | None = None
        self.last_reason: str | None = None
        self.verdicts = dict.fromkeys(VERDICTS, 0)
        self.holding = False  # the last pause verdict was "hold": a stream theta0 fails on
        self.hold_candidate = False  # that hold keeps the duelled candidate (else: theta0)
        self.auditing = False
        self.serving_candidate = False  # a periodic audit serves the current theta
        self.audits = 0
        self.last_duel: tuple[float | None, float | None] = (None, None)
        self.since_audit = 0

    def restart_windows(self) -> None:
        factor = window_factor(self.window)
        self.windows = SignalWindows(factor)
        self.source_windows = SignalWindows(factor)
        self.features = FeatureWindow(factor)
        self.source_features = FeatureWindow(factor)

    def start_audit(self, every: int | None, now: bool = False) -> bool:
        """True (and the audit begun) when ``every`` adapted samples have passed since the
        last audit (``every`` None: no periodic audits), or at once with ``now`` (a change of
        stream). A periodic audit serves the current theta (it adapted on this stream); one at a
        change serves theta0 until the duel's verdict (the ViT adapted to Gaussian noise of
        sigma 0.3 served the first 100 clean images at 80% where theta0 served 87%)."""
        if not now and (every is None or self.since_audit < every):
            return False
        self.since_audit = 0
        self.audits += 1
        self.auditing = True
        self.serving_candidate = not now
        self.restart_windows()
        return True

    def abandon_audit(self) -> None:
        """End the running audit without a verdict (the domain bank restored a theta learnt
        on this stream, see :mod:`.bank`); the windows restart for what follows."""
        self.auditing = self.serving_candidate = False
        self.restart_windows()

    @property
    def duel_margin(self) -> float:
        """How many times theta0's feature distance to the source the candidate may be at and
        still win the running duel where theta0 is healthy: ``change_margin`` in an audit at a
        change of stream, ``margin`` otherwise."""
        return self.change_margin if self.auditing and not self.serving_candidate else \
            self.margin

    def observe_pause(
        self, logits: np.ndarray, features: np.ndarray, dueled: bool
    ) -> None:
        """Add one paused batch: logits [rB, K] and features [rB, F], the candidate theta's
        rows (the checkpoint the trip rolled back to) first, then theta0's when ``dueled``
        (r = 2; r = 1 when the candidate is theta0)."""
        batch = logits.shape[0] // (2 if dueled else 1)
        self.windows.add(logits[:batch])
        self.features.add(features[:batch])
        if dueled:
            self.source_windows.add(logits[batch:])
            self.source_features.add(features[batch:])

    def pause_verdict(self, dueled: bool, needed: int) -> str:
        """Where adaptation resumes after a pause: ``checkpoint`` (keep the candidate),
        ``theta0``, or ``hold`` (serve theta0 without adapting for another pause). A side is
        healthy with ``needed`` samples in its window and every signal in bounds. theta0 not
        healthy: ``hold``, whatever the candidate's signals (the stream is out of the range
        the bounds were learnt on, so they vouch for nothing there: on the shipped ViT a
        candidate in bounds served severity-5 brightness at 30% where theta0 with the
        activation shift served 42%); ``hold_candidate`` then says whether the candidate is
        kept for the next duel: the blame is on the stream, not on what the candidate learnt,
        so it is kept unless it is over ``margin`` times as far from the source statistics as
        theta0 (at a change of stream too: on a stream theta0 fails on, the distances do not
        say which side learnt the right thing). theta0 healthy: ``checkpoint`` when the
        candidate is healthy and at most ``duel_margin`` times as far from the source as
        theta0, else ``theta0``. The windows restart for what follows."""
        def healthy(windows: SignalWindows, features: FeatureWindow) -> bool:
            if windows.samples < needed:
                return False
            alignment = None if self.source_stats is None else features.distance(
                self.source_stats)
            values = {"entropy": windows.entropy, "spread": windows.spread(),
                      "logit_norm": windows.logit_norm, "alignment": alignment}
            return self.bounds.violation(values) is None

        def closer_to_source(margin: float) -> bool:
            if self.source_stats is None:
                return True
            mine = self.features.distance(self.source_stats)
            theirs = self.source_features.distance(self.source_stats)
            self.last_duel = (mine, theirs)
            return mine is not None and theirs is not None and mine <= margin * theirs

        self.last_duel = (None, None)
        self.hold_candidate = False
        if dueled and not healthy(self.source_windows, self.source_features):
            verdict = "hold"
            self.hold_candidate = closer_to_source(self.margin)
        elif dueled:
            keep = healthy(self.windows, self.features) and closer_to_source(self.duel_margin)
            verdict = "checkpoint" if keep else "theta0"
        else:
            verdict = "theta0" if healthy(self.windows, self.features) else "hold"
        self.verdicts[verdict] += 1
        self.holding = verdict == "hold"
        self.auditing = self.serving_candidate = False
        self.since_audit = 0
        self.restart_windows()
        return verdict

    def observe(
        self, logits: np.ndarray, drift: float, alignment: float | None
    ) -> tuple[str | None, bool]:
        """Add a step's predictions and the current drift / feature distance. Returns (the
        reason of a trip or None, whether a healthy checkpoint is due now)."""
        self.windows.add(logits)
        batch = logits.shape[0]
        self.since_audit += batch
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
