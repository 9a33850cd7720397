"""The zeroth-order estimate with its arrays on the CUDA device (CuPy): the device step.

The same estimate as :class:`~.estimator.ZerothOrderEstimator` (Algorithm 1, lines 3-8), with
what grows with the batch kept where ORT computes it:

* the perturbations drawn there by a counter-based generator (:mod:`.counter_rng`: Philox keyed
  by seed, counted by step and row; the anchor-row choice and the anchor direction [P] come
  from the host, as on the CPU);
* the 2qB theta rows built there, from theta [P] copied once, and run by ORT from there
  (:meth:`~.session.AdaptableSession.run_device`, the batch resident since its check);
* the losses, coefficients and gradient computed there in float32.

What comes back: the prediction [B, K], the features' side means and squares [B, F] the
windowed moments need, the qB coefficients (clipped on the host at their running scale, then
sent back) and the gradient [P]. The update (:func:`~.update.apply_update`), the guard, the
budget and the state stay on the host: the state file, the domain bank and the guard's
roll-backs read theta there, and a [P] vector each way costs microseconds.

The numbers are not the CPU path's: another generator, float32 losses, the GPU's sums. The
agreement is statistical (``tests/integration/test_cuda.py``; on the CPU,
``tests/component/test_device_step.py`` runs this class over NumPy arrays against the float64
estimator). Written once for both namespaces: ``xp`` is CuPy on the device, NumPy for that test.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .config import AdaptConfig
from .counter_rng import NORMAL, UNIFORM, device_rows, draw_rows
from .estimator import GradientEstimate, Objective, PreparedEstimate
from .perturbation import PerturbationPlan, anchor_direction
from .session import AdaptableSession
from .state import AdaptState
from .stepcontrol import clip_coefficients


class DeviceEstimator:
    """Estimates the gradient at theta from one ORT call over #FP x B rows held in ``xp``
    (CuPy: the session's device; NumPy: the same algorithm on the host, for tests). The
    interface of :class:`~.estimator.ZerothOrderEstimator`: :meth:`estimate`, or
    :meth:`prepare`, :meth:`run` (the ORT call, no Python state), :meth:`combine`."""

    prefetch = None  # the generator is counter-based: nothing to draw ahead

    def __init__(
        self, session: AdaptableSession, config: AdaptConfig,
        source_stats: tuple[np.ndarray, np.ndarray] | None, xp: ModuleType,
    ) -> None:
        self.session = session
        self.config = config
        self.xp = xp
        device_stats = None if source_stats is None else \
            (self._array(source_stats[0]), self._array(source_stats[1]))
        self.objective = Objective(config, device_stats, dtype=np.float32)

    def _array(self, values: np.ndarray) -> Any:
        """A host array as a float32 array of ``xp``."""
        return self.xp.asarray(np.asarray(values, dtype=np.float32))

    def _draw(self, stream: int, seed: int, step: int, rows: int, width: int,
              first_row: int = 0) -> Any:
        if self.xp is np:
            return draw_rows(seed, step, stream, rows, width, first_row)
        return device_rows(seed, step, stream, rows, width, first_row)

    def estimate(
        self, x: np.ndarray, state: AdaptState, seed: int, step_index: int, n_anchor: int,
        control: bool, count: bool = True,
    ) -> GradientEstimate:
        """As :meth:`~.estimator.ZerothOrderEstimator.estimate`."""
        prepared = self.prepare(x, state, seed, step_index, n_anchor)
        logits, features = self.run(x, prepared)
        if count:
            self.session.counter.samples += x.shape[0]
        return self.combine(prepared, logits, features, state, control)

    def run(self, x: np.ndarray, prepared: PreparedEstimate) -> tuple[Any, Any]:
        """The ORT call on the prepared rows: (logits, features) in ``xp``."""
        if self.xp is np:
            return self.session.run(x, prepared.rows)
        return self.session.run_device(x, prepared.rows)

    def perturbations(self, plan: PerturbationPlan) -> Any:
        """The step's Z [plan rows, P] float32 in ``xp``: N(0, I) rows, the anchor-guided
        ones d_bar * U(0, 2) (each row its own counter: the same values in any order)."""
        size = plan.d_bar.size
        z = self._draw(NORMAL, plan.seed, plan.step, plan.rows, size)
        if plan.anchor_rows:
            d_bar = self._array(plan.d_bar)
            for row in plan.anchor_rows:
                z[row] = d_bar * self._draw(UNIFORM, plan.seed, plan.step, 1, size, row)[0]
        return z

    def prepare(
        self, x: np.ndarray, state: AdaptState, seed: int, step_index: int, n_anchor: int
    ) -> PreparedEstimate:
        """The perturbed theta rows [#FP x B, P] of the step in ``xp``, and what
        :meth:`combine` needs (Z itself unless ``regenerate_z``: it is drawn again there)."""
        cfg, st, xp = self.config, state, self.xp
        batch = x.shape[0]
        pairs = cfg.forwards // 2
        d_bar = anchor_direction(st.theta, st.anchor, cfg.delta) if n_anchor else \
            np.zeros_like(st.theta)
        plan = PerturbationPlan.create(
            seed, step_index, pairs * (batch if cfg.sample_wise else 1), n_anchor, d_bar)
        z = self.perturbations(plan)
        step = np.float32(cfg.mu) * z
        if not cfg.sample_wise:  # one z per pair for the whole batch
            step = xp.repeat(step, batch, axis=0)
        theta = self._array(st.theta)
        half = pairs * batch
        rows = xp.empty((2 * half, theta.size), dtype=np.float32)
        if cfg.two_sided:
            xp.add(theta, step, out=rows[:half])
            xp.subtract(theta, step, out=rows[half:])
        else:
            rows[:half] = theta
            xp.add(theta, step, out=rows[half:])
        return PreparedEstimate(plan, rows, None if cfg.regenerate_z else z, batch, pairs)

    def combine(
        self, prepared: PreparedEstimate, logits: Any, features: Any, state: AdaptState,
        control: bool,
    ) -> GradientEstimate:
        """The estimate from the ORT call's logits [#FP x B, K] and features [#FP x B, F] in
        ``xp`` (``state`` is only read; ``control``: clip the coefficients)."""
        cfg, st, xp = self.config, state, self.xp
        batch, pairs = prepared.batch, prepared.pairs
        half = pairs * batch
        lower, upper = slice(0, half), slice(half, 2 * half)
        if cfg.two_sided:
            prediction = logits.reshape(2 * pairs, batch, -1).mean(axis=0)
            h_all = features.reshape(2 * pairs, batch, -1)
            h_mean, h_sq = h_all.mean(axis=0), (h_all * h_all).mean(axis=0)
        else:
            prediction = logits[lower].copy()
            h_mean = features[lower].copy()
            h_sq = h_mean * h_mean
        if st.moments_ready:
            moments = (self._array(st.mean), self._array(st.second_moment))
        else:
            moments = (h_mean.mean(axis=0), h_sq.mean(axis=0))
        reference = xp.tile(prediction, (pairs, 1))
        center = self._array(st.center)

        def loss(rows: slice) -> Any:
            return self.objective(logits[rows], features[rows], reference, moments, center)

        if cfg.two_sided:
            coef_rows = (loss(lower) - loss(upper)) / np.float32(2.0 * cfg.mu)
        else:
            coef_rows = (loss(upper) - loss(lower)) / np.float32(cfg.mu)
        host = [np.asarray(a) if xp is np else a.get()
                for a in (coef_rows, prediction, h_mean, h_sq)]
        coef = host[0].astype(np.float64)
        clipped = None
        if control and np.isfinite(coef).all():
            clipped = clip_coefficients(
                coef, st.coef_scale, st.coef_weight, cfg.coef_clip, cfg.coef_window)
            coef = clipped.coef
        grad = self._gradient(prepared, coef)
        return GradientEstimate(host[1], grad, coef, host[2].astype(np.float64),
                                host[3].astype(np.float64), clipped)

    def _gradient(self, prepared: PreparedEstimate, coef: np.ndarray) -> np.ndarray:
        """g = (1/(qB)) sum coef_ji z_ji ([P] float64 on the host), the sum in float32 in
        ``xp`` (a shared z: the pair's mean coefficient times its z)."""
        z = prepared.z_all if prepared.z_all is not None else self.perturbations(prepared.plan)
        if not self.config.sample_wise:
            weights = coef.reshape(prepared.pairs, -1).mean(axis=1) / prepared.pairs
        else:
            weights = coef / coef.shape[0]
        grad = self._array(weights) @ z
        return (np.asarray(grad) if self.xp is np else grad.get()).astype(np.float64)
