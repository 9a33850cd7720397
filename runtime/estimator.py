"""The zeroth-order gradient estimate of one EVA-0-family step (Algorithm 1, lines 3-8).

Perturbed rows (sample-wise or shared z, some anchor-guided), one ORT call over all of them, the
per-row objective of each half, the coefficients of the z's (clipped at their running scale) and
the gradient g = (1/qB) sum c z. Nothing here writes the adaptation state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import AdaptConfig
from .losses import sample_wise_alignment, shortcut_resistant_scores, softmax_entropy
from .perturbation import NormalPrefetch, PerturbationPlan, anchor_direction
from .session import AdaptableSession
from .state import AdaptState
from .stepcontrol import ClippedCoefficients, clip_coefficients

REGENERATE_CHUNK_ROWS = 8


@dataclass
class GradientEstimate:
    """One estimator evaluation: prediction [B, K] (logits), grad [P] (float64), coef [qB]
    (the scalar multiplying z_i, after clipping), h_mean / h_sq [B, F] (features and squares,
    side-averaged), control: the clipping outcome (None when not clipped, see ``estimate``)."""

    prediction: np.ndarray
    grad: np.ndarray
    coef: np.ndarray
    h_mean: np.ndarray
    h_sq: np.ndarray
    control: ClippedCoefficients | None = None


@dataclass
class PreparedEstimate:
    """A step's perturbed rows before the ORT call: the plan, theta rows [#FP x B, P], Z
    [plan rows, P] (None when regenerated), the batch B and the pairs q. The rows and Z are
    host arrays, or CuPy arrays of the device step (:mod:`.device_step`)."""

    plan: PerturbationPlan
    rows: Any
    z_all: Any
    batch: int
    pairs: int


class Objective:
    """The per-row objective: shortcut-resistant entropy E_SR of the logits, plus lambda x the
    sample-wise alignment l_SWA of the features to the source statistics (when the model has
    them and ``lambda_swa`` > 0)."""

    def __init__(
        self, config: AdaptConfig, source_stats: tuple[np.ndarray, np.ndarray] | None
    ) -> None:
        self.config = config
        self.source_stats = source_stats

    def __call__(
        self,
        logits: np.ndarray,
        features: np.ndarray,
        reference: np.ndarray,
        moments: tuple[np.ndarray, np.ndarray],
        center: np.ndarray,
    ) -> np.ndarray:
        """Per-row objective [rows] of one half; ``moments`` = target (mean, E[h^2]) [F];
        ``center``: the output centre [K] (used when ``config.center``)."""
        cfg = self.config
        ref_norm = np.linalg.norm(reference, axis=1) if cfg.shortcut_resistant else None
        scores = shortcut_resistant_scores(
            logits.astype(np.float64), ref_norm, center if cfg.center else None, cfg.eps
        )
        loss = softmax_entropy(scores)
        if cfg.lambda_swa > 0:
            if self.source_stats is None:
                raise ValueError("lambda_swa > 0 needs the model's source statistics")
            source_mean, source_std = self.source_stats
            loss = loss + cfg.lambda_swa * sample_wise_alignment(
                features, *moments, source_mean, source_std, cfg.rho, cfg.eps
            )
        return loss


class ZerothOrderEstimator:
    """Estimates the gradient of the objective at theta from one ORT call (#FP x B rows).

    ``prefetch``: draw the next step's normal rows on a worker thread while ORT runs this
    step's call (the same rows, see :class:`~.perturbation.NormalPrefetch`); it pays where ORT
    leaves the host idle (CUDA), not where ORT's threads hold every core (CPU). Never with
    ``regenerate_z``, whose point is not to hold Z."""

    def __init__(
        self, session: AdaptableSession, config: AdaptConfig, objective: Objective,
        prefetch: bool = False,
    ) -> None:
        self.session = session
        self.config = config
        self.objective = objective
        self.prefetch = NormalPrefetch() if prefetch and not config.regenerate_z else None

    def estimate(
        self, x: np.ndarray, state: AdaptState, seed: int, step_index: int, n_anchor: int,
        control: bool, count: bool = True,
    ) -> GradientEstimate:
        """The estimate on the checked batch ``x`` [B, C, H, W] at ``state.theta``, from the
        perturbation stream (``seed``, ``step_index``), with ``n_anchor`` anchor-guided rows;
        ``control``: clip the coefficients at their running scale (``state`` is only read; the
        session's forward counter counts the rows, and the batch's samples unless ``count`` is
        False: they were counted when served). :meth:`prepare`, the ORT call, :meth:`combine`."""
        prepared = self.prepare(x, state, seed, step_index, n_anchor)
        logits, features = self.run(x, prepared)
        if count:
            self.session.counter.samples += x.shape[0]
        return self.combine(prepared, logits, features, state, control)

    def run(self, x: np.ndarray, prepared: PreparedEstimate) -> tuple[np.ndarray, np.ndarray]:
        """The ORT call on the prepared rows: (logits, features). It holds no Python state, so
        it may run on another thread."""
        return self.session.run(x, prepared.rows)

    def prepare(
        self, x: np.ndarray, state: AdaptState, seed: int, step_index: int, n_anchor: int
    ) -> PreparedEstimate:
        """The perturbed theta rows [#FP x B, P] of the step (and what :meth:`combine` needs;
        :meth:`run` is the ORT call on them)."""
        cfg, st = self.config, state
        batch = x.shape[0]
        d_bar = (
            anchor_direction(st.theta, st.anchor, cfg.delta)
            if n_anchor
            else np.zeros_like(st.theta)
        )
        pairs = cfg.forwards // 2
        size = st.theta.size
        ahead = self.prefetch.take(seed, step_index, size) if self.prefetch else None
        plan = PerturbationPlan.create(
            seed, step_index, pairs * (batch if cfg.sample_wise else 1), n_anchor, d_bar, ahead
        )
        rows, z_all = self._perturbed_rows(plan, st.theta, batch, pairs)
        if self.prefetch:  # the next step's rows, drawn while ORT runs this one
            self.prefetch.start(seed, step_index + 1, plan.rows, size)
        return PreparedEstimate(plan, rows, z_all, batch, pairs)

    def combine(
        self, prepared: PreparedEstimate, logits: np.ndarray, features: np.ndarray,
        state: AdaptState, control: bool,
    ) -> GradientEstimate:
        """The estimate from the ORT call's logits [#FP x B, K] and features [#FP x B, F] on
        the prepared rows (``state`` is only read; ``control``: clip the coefficients)."""
        cfg, st = self.config, state
        batch, pairs = prepared.batch, prepared.pairs
        half = pairs * batch  # rows j * B + i: pair j, sample i (each half copy-major)
        lower, upper = slice(0, half), slice(half, 2 * half)
        if cfg.two_sided:  # rows theta + mu z (lower half), theta - mu z (upper half)
            plus, minus = lower, upper
            prediction = logits.reshape(2 * pairs, batch, -1).mean(axis=0)
            h_all = features.astype(np.float64).reshape(2 * pairs, batch, -1)
            h_mean, h_sq = h_all.mean(axis=0), (h_all**2).mean(axis=0)
        else:  # rows theta (lower half: the prediction), theta + mu z (upper half)
            clean, perturbed = lower, upper
            prediction = self.session.owned(logits[clean])
            h_mean = features[clean].astype(np.float64)
            h_sq = h_mean**2
        if st.moments_ready:
            moments = (st.mean, st.second_moment)
        else:  # before the first step the target moments come from the batch itself
            moments = (h_mean.mean(axis=0), h_sq.mean(axis=0))
        reference = np.tile(prediction.astype(np.float64), (pairs, 1))

        def loss(rows: slice) -> np.ndarray:
            """The per-row objective [qB] of one half of the rows."""
            return self.objective(
                logits[rows], features[rows].astype(np.float64), reference, moments, st.center
            )

        # the coefficient of each z: two-sided (l+ - l-) / (2 mu), one-sided (l(z) - l(0)) / mu
        if cfg.two_sided:
            coef = (loss(plus) - loss(minus)) / (2.0 * cfg.mu)
        else:
            coef = (loss(perturbed) - loss(clean)) / cfg.mu
        clipped = None
        if control and np.isfinite(coef).all():
            clipped = clip_coefficients(
                coef, st.coef_scale, st.coef_weight, cfg.coef_clip, cfg.coef_window
            )
            coef = clipped.coef
        grad = self._gradient(prepared.plan, coef, prepared.z_all, pairs)
        return GradientEstimate(prediction, grad, coef, h_mean, h_sq, clipped)

    def _perturbed_rows(
        self, plan: PerturbationPlan, theta: np.ndarray, batch: int, pairs: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The [2qB, P] theta input (q = ``pairs``); also Z [plan rows, P] unless it is
        regenerated later. A shared z (one per pair) fills all B rows of its pair."""
        cfg = self.config
        half = pairs * batch
        rows = np.empty((2 * half, theta.size), dtype=np.float32)
        chunk = REGENERATE_CHUNK_ROWS if cfg.regenerate_z else plan.rows
        kept = []
        for sl, z in plan.chunks(chunk):
            step = cfg.mu * z
            if not cfg.sample_wise:  # one z per pair for the whole batch
                step = np.repeat(step, batch, axis=0)
                sl = slice(sl.start * batch, sl.stop * batch)
            if cfg.two_sided:
                rows[sl] = theta + step
                rows[half + sl.start : half + sl.stop] = theta - step
            else:
                rows[sl] = theta
                rows[half + sl.start : half + sl.stop] = theta + step
            if not cfg.regenerate_z:
                kept.append(z)
        return rows, (np.concatenate(kept) if kept else None)

    def _gradient(
        self, plan: PerturbationPlan, coef: np.ndarray, z_all: np.ndarray | None, pairs: int
    ) -> np.ndarray:
        """g = (1/(qB)) sum_(j,i) coef_ji z_ji ([P] float64), over the q pairs of the B samples;
        Z regenerated chunk by chunk if asked."""
        count = coef.shape[0]
        if not self.config.sample_wise:
            z = z_all if z_all is not None else plan.draw()
            return (coef.reshape(pairs, -1).mean(axis=1) @ z.astype(np.float64)) / pairs
        if z_all is not None:
            return (coef @ z_all.astype(np.float64)) / count
        grad = np.zeros(plan.d_bar.size, dtype=np.float64)
        for sl, z in plan.chunks(REGENERATE_CHUNK_ROWS):
            grad += coef[sl] @ z.astype(np.float64)
        return grad / count

