"""The EVA-0 engine and its forward-only relatives over an adaptable ONNX model (NumPy only).

One step on a batch x [B, C, H, W]:

1. perturbations z_i (sample-wise, or one shared z), k per 64 of them anchor-guided; with
   ``forwards`` = 2q > 2, q of them per sample (or q shared ones);
2. one ORT call over 2B rows: [theta + mu z; theta - mu z] (two-sided) or [theta; theta + mu z]
   (one-sided), the prefix shared inside the graph (2qB rows for q pairs);
3. prediction: the mean of the two sides (of all 2q rows) or the clean row (one-sided);
4. per-side loss E_SR(o) + lambda l_SWA(h); coefficients c_i = (l+_i - l-_i) / (2 mu), each
   clipped at a multiple of their running scale; g = (1/B) sum_i c_i z_i (over the qB pairs);
5. theta <- (1 - gamma) (theta - eta g) + gamma theta_anchor, the step cut to a trust radius;
   windowed means of centre and moments. The rates are per reference batch of 64 samples,
   converted to B (:mod:`rates`), so they mean the same at every batch size.

A non-finite loss, gradient or theta is never written: the step is skipped and counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import AdaptConfig
from .guard import GuardBounds, HealthGuard, alignment_distance
from .losses import sample_wise_alignment, shortcut_resistant_scores, softmax_entropy
from .metadata import ModelMetadata
from .perturbation import AnchorShare, PerturbationPlan, anchor_direction
from .rates import statistics_window, step_rates, window_factor, windowed_update
from .registry import REGISTRY, MethodSpec, parse_method
from .session import AdaptableSession
from .state import (
    AdaptState,
    StateError,
    decode_state,
    encode_state,
    read_state_file,
    write_state_file,
)
from .stepcontrol import ClippedCoefficients, clip_coefficients, limit_step

log = logging.getLogger(__name__)

METHODS: dict[str, MethodSpec] = {n: s for n, s in REGISTRY.items() if s.kind == "engine"}
PROMPT_ONLY = tuple(name for name, spec in METHODS.items() if spec.prompt_model)

REGENERATE_CHUNK_ROWS = 8


def model_fingerprint(metadata: ModelMetadata) -> str:
    """Identifies the adapted parameter space: architecture, layouts and theta0."""
    h = hashlib.sha256()
    h.update(metadata.architecture.encode())
    h.update(repr([(s.name, s.size) for s in metadata.theta_layout]).encode())
    h.update(repr([(s.name, s.size) for s in metadata.feature_layout]).encode())
    h.update(np.ascontiguousarray(metadata.theta0, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


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
class StepStats:
    """What the last step saw: mean prediction entropy (nats), mean logit norm, skipped, and how
    many of its perturbations were anchor-guided."""

    entropy: float = float("nan")
    logit_norm: float = float("nan")
    skipped: bool = False
    anchor_rows: int = 0


class AdaptiveModel:
    """An adaptable model plus a method and its state.

    >>> model = AdaptiveModel.load("vit.onnx", method="eva0", seed=0)
    >>> logits = model.step(x)  # predicts and adapts; x: [B, C, H, W] normalised float32
    """

    def __init__(
        self,
        session: AdaptableSession,
        method: str = "eva0",
        config: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        method, fp = parse_method(method)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; runtime methods: {sorted(METHODS)}")
        self.session = session
        self.metadata = session.metadata
        if method in PROMPT_ONLY and not self.metadata.is_prompt_model:
            raise ValueError(
                f"{method} adapts input prompts: export the ViT with `eva0-edge export "
                "--prompts T` (this file adapts norm parameters)"
            )
        self.spec = METHODS[method]
        self.config = self._resolve_config({**fp, **(config or {})})
        self.fingerprint = model_fingerprint(self.metadata)
        arrays = self.metadata.arrays
        self._source_stats = (
            (arrays["source_mean"].astype(np.float64), arrays["source_std"].astype(np.float64))
            if self.metadata.has_source_stats
            else None
        )
        self.seed = int(seed)
        self.last = StepStats()
        self.reset()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        method: str = "eva0",
        config: dict[str, Any] | None = None,
        seed: int = 0,
        provider: str = "auto",
        threads: int | None = None,
        low_memory: bool = False,
        io_binding: bool = False,
    ) -> AdaptiveModel:
        """Open an adaptable ``.onnx`` file with ONNX Runtime (``low_memory``, ``io_binding``:
        see :class:`AdaptableSession`)."""
        session = AdaptableSession(path, None, provider, threads, low_memory, io_binding)
        return cls(session, method, config, seed)

    @property
    def method(self) -> str:
        return self.spec.name

    def _resolve_config(self, overrides: dict[str, Any]) -> AdaptConfig:
        config = AdaptConfig().updated(self.metadata.recommended)
        config = config.updated(self.spec.overrides)
        config = config.updated(self.metadata.tuned.get(self.method, {})).updated(overrides)
        if config.lambda_swa > 0 and not self.metadata.has_source_stats:
            if self.spec.adapts:
                log.warning(
                    "%s: model has no source statistics; lambda_swa set to 0 (source-free). "
                    "Run `eva0-edge calibrate` to add them.",
                    self.method,
                )
            config = config.updated({"lambda_swa": 0.0})
        if config.mu <= 0 or config.eta < 0 or not 0 <= config.gamma <= 1:
            raise ValueError("need mu > 0, eta >= 0 and 0 <= gamma <= 1")
        if not 0 <= config.alpha < 1 or not 0 <= config.momentum < 1:
            raise ValueError("need 0 <= alpha < 1 and 0 <= momentum < 1")
        if config.reference_batch < 1 or config.coef_window < 1 or (
            config.stat_window is not None and config.stat_window < 1
        ):
            raise ValueError("need reference_batch >= 1, coef_window >= 1, stat_window >= 1")
        if (config.coef_clip is not None and config.coef_clip <= 0) or (
            config.trust_radius is not None and config.trust_radius <= 0
        ):
            raise ValueError("coef_clip and trust_radius must be > 0 (or None: off)")
        fp = config.forwards
        if self.spec.adapts and (fp < 2 or fp % 2 or (fp != 2 and not config.two_sided)):
            raise ValueError(
                f"{self.method}: #FP (forwards) must be an even number >= 2 "
                f"(exactly 2 for one-sided methods), got {fp}"
            )
        return config

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Back to the source parameters and empty online statistics (same seed)."""
        md = self.metadata
        self.state = AdaptState.initial(md.theta0, md.num_classes, md.num_features, self.seed)
        self._share = AnchorShare(self.config.anchor_per_64)
        self.guard = self._new_guard()
        self.last = StepStats()

    def _new_guard(self) -> HealthGuard | None:
        cfg = self.config
        if not (cfg.guard and self.spec.adapts):
            return None
        bounds = GuardBounds(**{
            name: getattr(cfg, f"guard_{name}") for name in GuardBounds.__dataclass_fields__
        })
        return HealthGuard(bounds, cfg.guard_window, cfg.guard_warmup, cfg.guard_checkpoint)

    def freeze(self, frozen: bool = True) -> None:
        """Predict with the current theta and stop adapting (``frozen``), or resume."""
        self.state.frozen = bool(frozen)

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state (arrays and scalars)."""
        self.state.anchor_credit = self._share.credit
        return self.state.to_dict()

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Replace the state; shapes are checked before anything changes."""
        state = AdaptState.from_dict(values)
        self._check_shapes(state)
        self._install(state)

    def _state_sizes(self) -> dict[str, int]:
        """Elements of every state array for this model."""
        md = self.metadata
        return {
            "theta": md.num_params, "anchor": md.num_params, "velocity": md.num_params,
            "healthy_theta": md.num_params,
            "center": md.num_classes, "mean": md.num_features, "second_moment": md.num_features,
        }

    def _check_shapes(self, state: AdaptState) -> None:
        for name, size in self._state_sizes().items():
            if getattr(state, name).shape != (size,):
                raise StateError(
                    f"state {name} has shape {getattr(state, name).shape}, model needs ({size},)"
                )

    def _install(self, state: AdaptState) -> None:
        self.state = state
        self.seed = state.seed
        self._share = AnchorShare(self.config.anchor_per_64)
        self._share.credit = state.anchor_credit
        self.guard = self._new_guard()  # the signal windows warm up again

    def state_bytes(self) -> bytes:
        """The state as checksummed npz bytes (see :mod:`state`)."""
        self.state.anchor_credit = self._share.credit
        return encode_state(self.state, self.fingerprint, {"method": self.method})

    def parse_state_bytes(self, data: bytes) -> AdaptState:
        """Decode and validate state bytes for this model (sizes from the archive headers
        first, checksum, fingerprint, every value and shape) without touching the current
        state, so it may run on any thread; StateError names what is wrong."""
        state, _ = decode_state(data, self.fingerprint, self._state_sizes())
        self._check_shapes(state)
        return state

    def install_state(self, state: AdaptState) -> None:
        """Replace the state with one from :meth:`parse_state_bytes`."""
        self._install(state)

    def load_state_bytes(self, data: bytes) -> None:
        self._install(self.parse_state_bytes(data))

    def save_state(self, path: str | os.PathLike) -> Path:
        """Write the state atomically (temp file, fsync, rename)."""
        return write_state_file(path, self.state_bytes())

    def load_state(self, path: str | os.PathLike) -> None:
        """Load a state file written by :meth:`save_state` for this model."""
        state, _ = read_state_file(path, self.fingerprint, self._state_sizes())
        self._check_shapes(state)
        self._install(state)

    # ----------------------------------------------------------------- stats
    @property
    def forwards_per_sample(self) -> float:
        return self.session.counter.per_sample

    def stats(self) -> dict[str, Any]:
        """Counters and health of the adaptation (JSON-serialisable)."""
        counter = self.session.counter
        drift = self._drift()
        return {
            "method": self.method,
            "steps": self.state.step,
            "skipped_steps": self.state.skipped,
            "samples": counter.samples,
            "forwards": counter.forwards,
            "forwards_per_sample": counter.per_sample,
            "clipped_coefficients": self.state.clipped_coefs,
            "clipped_steps": self.state.clipped_steps,
            "drift": drift,
            "mean_entropy": self.last.entropy,
            "mean_logit_norm": self.last.logit_norm,
            "frozen": self.state.frozen,
            "paused_samples_left": self.state.pause_left,
            "guard": None if self.guard is None else {
                "trips": self.state.guard_trips,
                "last_reason": self.guard.last_reason,
                "signals": self.guard.values(drift, self._alignment()),
                "bounds": asdict(self.guard.bounds),
            },
        }

    def _drift(self) -> float:
        return float(np.linalg.norm(self.state.theta - self.metadata.theta0))

    def _alignment(self) -> float | None:
        if self._source_stats is None or not self.state.moments_ready:
            return None
        return alignment_distance(self.state.mean, self.state.second_moment, *self._source_stats)

    # ----------------------------------------------------------------- inference
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [B, K] under the current theta, one forward per sample, no adaptation."""
        x = self.session.check_input(x)
        theta = np.broadcast_to(self.state.theta, (x.shape[0], self.state.theta.size))
        logits, _ = self.session.run(x, theta)
        self.session.counter.samples += x.shape[0]
        self._record(logits)
        return self.session.owned(logits)

    def step(self, x: np.ndarray) -> np.ndarray:
        """Predict and (for adapting methods) adapt on the batch; returns logits [B, K]."""
        if not self.spec.adapts:
            return self.predict(x)
        if self.state.frozen or self.state.pause_left > 0:
            logits = self.predict(x)
            self.state.pause_left = max(0, self.state.pause_left - logits.shape[0])
            return logits
        x = self.session.check_input(x)
        n_anchor = self._share.take(x.shape[0]) if self.config.sample_wise else 0
        est = self._estimate(x, self.state.step, n_anchor, control=True)
        self._record(est.prediction)
        self.last.anchor_rows = n_anchor
        self.state.step += 1
        if not (np.isfinite(est.coef).all() and np.isfinite(est.grad).all()):
            return self._skip(est.prediction, "non-finite loss or gradient")
        if not self._update(est):
            return self._skip(est.prediction, "non-finite theta")
        if self.guard is not None:
            self._watch(est.prediction)
        return est.prediction

    def _watch(self, prediction: np.ndarray) -> None:
        """Feed the health guard; checkpoint when healthy, roll back when it trips."""
        reason, checkpoint = self.guard.observe(prediction, self._drift(), self._alignment())
        st = self.state
        if checkpoint:
            st.healthy_theta = st.theta.copy()
        if reason is None:
            return
        to_source = self.guard.tripped(reason)
        if to_source:
            st.healthy_theta = self.metadata.theta0.astype(np.float32).copy()
        st.theta = st.healthy_theta.copy()
        st.velocity = np.zeros_like(st.velocity)
        st.stat_weight = 0.0  # the statistics saw the unhealthy stream: start them again
        st.guard_trips += 1
        st.pause_left = self.config.guard_pause
        log.warning(
            "health guard tripped at step %d: %s; rolled back to %s, adaptation paused for "
            "%d samples", st.step, reason, "theta0" if to_source else "the last healthy theta",
            st.pause_left,
        )

    def estimate(self, x: np.ndarray, step_index: int | None = None) -> GradientEstimate:
        """The method's zeroth-order gradient estimate on ``x`` at the current theta, from the
        perturbation stream of ``step_index`` (default: the next step), with no anchor-guided
        rows, no coefficient clipping and no change to the state. One ORT call over #FP x B
        rows."""
        x = self.session.check_input(x)
        index = self.state.step if step_index is None else int(step_index)
        return self._estimate(x, index, 0, control=False)

    def _estimate(
        self, x: np.ndarray, step_index: int, n_anchor: int, control: bool
    ) -> GradientEstimate:
        cfg, st = self.config, self.state
        batch = x.shape[0]
        d_bar = (
            anchor_direction(st.theta, st.anchor, cfg.delta)
            if n_anchor
            else np.zeros_like(st.theta)
        )
        pairs = cfg.forwards // 2
        plan = PerturbationPlan.create(
            self.seed, step_index, pairs * (batch if cfg.sample_wise else 1), n_anchor, d_bar
        )
        rows, z_all = self._perturbed_rows(plan, batch, pairs)
        logits, features = self.session.run(x, rows)
        self.session.counter.samples += batch
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
            return self._loss(logits[rows], features[rows].astype(np.float64), reference, moments)

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
        grad = self._gradient(plan, coef, z_all, pairs)
        return GradientEstimate(prediction, grad, coef, h_mean, h_sq, clipped)

    # ----------------------------------------------------------------- internals
    def _perturbed_rows(
        self, plan: PerturbationPlan, batch: int, pairs: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The [2qB, P] theta input (q = ``pairs``); also Z [plan rows, P] unless it is
        regenerated later. A shared z (one per pair) fills all B rows of its pair."""
        cfg, theta = self.config, self.state.theta
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

    def _loss(
        self,
        logits: np.ndarray,
        features: np.ndarray,
        reference: np.ndarray,
        moments: tuple[np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """Per-sample objective [B] of one side; ``moments`` = target (mean, E[h^2]) [F]."""
        cfg = self.config
        ref_norm = np.linalg.norm(reference, axis=1) if cfg.shortcut_resistant else None
        center = self.state.center if cfg.center else None
        scores = shortcut_resistant_scores(logits.astype(np.float64), ref_norm, center, cfg.eps)
        loss = softmax_entropy(scores)
        if cfg.lambda_swa > 0:
            source_mean, source_std = self._source_stats
            loss = loss + cfg.lambda_swa * sample_wise_alignment(
                features, *moments, source_mean, source_std, cfg.rho, cfg.eps
            )
        return loss

    def _update(self, est: GradientEstimate) -> bool:
        """Apply the SGD step, balancing, trust radius, relaxation and the windowed statistics,
        at the rates of this batch size; False (nothing written) if the new theta is not
        finite."""
        cfg, st = self.config, self.state
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
            delta, balance_in, balance_out = _balance(
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
        self._update_statistics(est)
        return True

    def _update_statistics(self, est: GradientEstimate) -> None:
        """Centre and moments: windowed means over the last W samples, in stream order."""
        st = self.state
        factor = window_factor(statistics_window(self.config))
        weight = st.stat_weight
        st.center, _ = windowed_update(
            st.center, weight, est.prediction.astype(np.float64), factor
        )
        st.mean, _ = windowed_update(st.mean, weight, est.h_mean, factor)
        st.second_moment, st.stat_weight = windowed_update(
            st.second_moment, weight, est.h_sq, factor
        )

    def _record(self, prediction: np.ndarray) -> None:
        p = prediction.astype(np.float64)
        self.last = StepStats(
            entropy=float(softmax_entropy(p).mean()),
            logit_norm=float(np.linalg.norm(p, axis=1).mean()),
        )

    def _skip(self, prediction: np.ndarray, why: str) -> np.ndarray:
        self.state.skipped += 1
        self.last.skipped = True
        log.warning("step %d skipped: %s", self.state.step, why)
        return prediction


def _balance(
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
