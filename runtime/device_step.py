"""The zeroth-order estimate with its large arrays on the CUDA device (CuPy): the device step.

The estimate of :class:`~.estimator.ZerothOrderEstimator` (Algorithm 1, lines 3-8) with what
grows with the batch times the parameters kept where ORT computes:

* the perturbations Z [qB, P] drawn there by a counter-based generator (:mod:`.counter_rng`:
  Philox keyed by seed, counted by step and row; the anchor-row choice and the anchor direction
  [P] come from the host, as on the CPU);
* the 2qB theta rows built there from theta [P], copied once, and run by ORT from there
  (:meth:`~.session.AdaptableSession.run_device`, the batch resident since its check);
* the gradient g = Z^T c / qB computed there (float32) and copied back as [P].

The ORT call's outputs, [2qB, K] logits and [2qB, F] features, come back to the host, where the
objective, the coefficients and their clipping run in float64 as on the CPU (the same code).
A first version computed them in float32 on the device: about a hundred small kernels a step,
and on an H200 its step cost 2.96x NoAdapt at batch 1 against the host step's 2.28x
(ResNet50-GN, ``results/h200-2026-12-04/first/``); at mu = 0.06 with lambda_swa = 500 its
differences lost up to 2e-3 of the coefficients to float32 cancellation. The copy back is
0.8 MB at batch 32. The update
(:func:`~.update.apply_update`), the guard, the budget and the state stay on the host too: the
state file, the domain bank and the guard's roll-backs read theta there, and a [P] vector each
way costs microseconds.

The numbers are not the CPU path's: another generator and the GPU's sums. The agreement is
statistical (``tests/integration/test_cuda.py``); on the CPU, this class over NumPy arrays
(``xp`` = NumPy: the reference generator, host rows) checks the algorithm against the host
estimator (``tests/component/test_device_step.py``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .arrays import to_host
from .config import AdaptConfig
from .counter_rng import NORMAL, UNIFORM, device_rows, draw_rows
from .estimator import GradientEstimate, Objective, PreparedEstimate, ZerothOrderEstimator
from .perturbation import PerturbationPlan, anchor_direction
from .session import AdaptableSession
from .state import AdaptState


class DeviceEstimator(ZerothOrderEstimator):
    """:class:`~.estimator.ZerothOrderEstimator` with Z, the theta rows and the gradient held
    in ``xp`` (CuPy: the session's device; NumPy: the same algorithm on the host, for tests).
    Nothing is drawn ahead: the generator is counter-based."""

    def __init__(
        self, session: AdaptableSession, config: AdaptConfig, objective: Objective,
        xp: ModuleType,
    ) -> None:
        super().__init__(session, config, objective, prefetch=False)
        self.xp = xp

    def _array(self, values: np.ndarray) -> Any:
        """A host array as a float32 array of ``xp``."""
        return self.xp.asarray(np.asarray(values, dtype=np.float32))

    def _draw(self, stream: int, seed: int, step: int, rows: int, width: int,
              first_row: int = 0) -> Any:
        if self.xp is np:
            return draw_rows(seed, step, stream, rows, width, first_row)
        return device_rows(seed, step, stream, rows, width, first_row)

    def run(self, x: np.ndarray, prepared: PreparedEstimate) -> tuple[Any, Any]:
        """The ORT call on the prepared rows: (logits, features), in ``xp``."""
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
        :meth:`combine` needs. Z is not kept (MeZO's seed trick, free with a counter-based
        generator: the gradient draws it again, the same numbers), so the step holds the rows
        and nothing of their size beside them."""
        cfg, st, xp = self.config, state, self.xp
        batch = x.shape[0]
        pairs = cfg.forwards // 2
        d_bar = anchor_direction(st.theta, st.anchor, cfg.delta) if n_anchor else \
            np.zeros_like(st.theta)
        plan = PerturbationPlan.create(
            seed, step_index, pairs * (batch if cfg.sample_wise else 1), n_anchor, d_bar)
        theta = self._array(st.theta)
        half = pairs * batch
        rows = xp.empty((2 * half, theta.size), dtype=np.float32)
        step = rows[half:]  # mu z, then the rows built around it in place
        z = self.perturbations(plan)
        if cfg.sample_wise:
            xp.multiply(z, np.float32(cfg.mu), out=step)
        else:  # one z per pair for the whole batch
            step[...] = xp.repeat(np.float32(cfg.mu) * z, batch, axis=0)
        del z
        if cfg.two_sided:
            xp.add(theta, step, out=rows[:half])
            xp.subtract(theta, step, out=step)
        else:
            rows[:half] = theta
            xp.add(theta, step, out=step)
        return PreparedEstimate(plan, rows, None, batch, pairs)

    def combine(
        self, prepared: PreparedEstimate, logits: Any, features: Any, state: AdaptState,
        control: bool,
    ) -> GradientEstimate:
        """The estimate from the ORT call's logits [#FP x B, K] and features [#FP x B, F] in
        ``xp``: copied to the host for the objective (float64), the gradient in ``xp``."""
        return super().combine(prepared, to_host(logits), to_host(features), state, control)

    def _gradient(
        self, plan: PerturbationPlan, coef: np.ndarray, z_all: Any, pairs: int
    ) -> np.ndarray:
        """g = (1/(qB)) sum_(j,i) coef_ji z_ji ([P] float64 on the host), the sum in float32
        in ``xp`` (a shared z: the pair's mean coefficient times its z), over Z drawn again."""
        z = self.perturbations(plan)
        if self.config.sample_wise:
            weights = coef / coef.shape[0]
        else:
            weights = coef.reshape(pairs, -1).mean(axis=1) / pairs
        return to_host(self._array(weights) @ z).astype(np.float64)
