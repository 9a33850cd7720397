"""The EVA-0 engine and its forward-only relatives over an adaptable ONNX model (NumPy only).

One step on a batch x [B, C, H, W]:

1. perturbations z_i (sample-wise, or one shared z), k per 64 of them anchor-guided; with
   ``forwards`` = 2q > 2, q of them per sample (or q shared ones);
2. one ORT call over 2B rows: [theta + mu z; theta - mu z] (two-sided) or [theta; theta + mu z]
   (one-sided), the prefix shared inside the graph (2qB rows for q pairs);
3. prediction: the mean of the two sides (of all 2q rows) or the clean row (one-sided),
   moved by the activation shift's logit offset when it is on (:mod:`.shift`, no forward);
4. per-side loss E_SR(o) + lambda l_SWA(h); coefficients c_i = (l+_i - l-_i) / (2 mu), each
   clipped at a multiple of their running scale; g = (1/B) sum_i c_i z_i (over the qB pairs);
5. theta <- (1 - gamma) (theta - eta g) + gamma theta_anchor, the step cut to a trust radius;
   windowed means of centre and moments. The rates are per reference batch of 64 samples,
   converted to B (:mod:`rates`), so they mean the same at every batch size.

A non-finite loss, gradient or theta is never written: the step is skipped and counted.

Steps 1-4 are :class:`~.estimator.ZerothOrderEstimator` (the objective:
:class:`~.estimator.Objective`), step 5 :func:`~.update.apply_update`; the rates are in
:mod:`.rates`, the state and its file format in :mod:`.state`. :class:`AdaptiveModel` owns the
state and does estimate -> update; what happens to a batch (serve, adapt, the health guard's
duels, the compute budget) is decided in one place, :mod:`.controller`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .budget import ComputeBudget, check_budget
from .config import AdaptConfig
from .controller import StepController
from .estimator import GradientEstimate, Objective, PreparedEstimate, ZerothOrderEstimator
from .guard import HealthGuard, alignment_distance
from .head import HeadError
from .metadata import ModelMetadata
from .monitoring import Health, StepStats
from .perturbation import AnchorShare
from .registry import REGISTRY, MethodSpec, parse_method
from .session import AdaptableSession
from .shift import ActivationShift, load_shift
from .state import (
    AdaptState,
    StateError,
    check_state_sizes,
    decode_state,
    encode_state,
    read_state_file,
    write_state_file,
)
from .statelimits import MAX_PAUSE_BATCH, SCALE_MARGIN, StateLimits
from .update import apply_update

log = logging.getLogger(__name__)

METHODS: dict[str, MethodSpec] = {n: s for n, s in REGISTRY.items() if s.kind == "engine"}
PROMPT_ONLY = tuple(name for name, spec in METHODS.items() if spec.prompt_model)

def model_fingerprint(metadata: ModelMetadata) -> str:
    """Identifies the adapted parameter space: architecture, layouts and theta0."""
    h = hashlib.sha256()
    h.update(metadata.architecture.encode())
    h.update(repr([(s.name, s.size) for s in metadata.theta_layout]).encode())
    h.update(repr([(s.name, s.size) for s in metadata.feature_layout]).encode())
    h.update(np.ascontiguousarray(metadata.theta0, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ServedPass:
    """An adaptation pass on a batch already served (the asynchronous server), begun on the
    thread that owns the state: the checked batch x [B, C, H, W], the state it estimates on
    and that state's step index and generation (see :meth:`AdaptiveModel.current`) when it
    began, how many of its rows are anchor-guided, and its perturbed rows."""

    x: np.ndarray
    state: AdaptState
    step: int
    generation: int
    n_anchor: int
    prepared: PreparedEstimate


class AdaptiveModel:
    """An adaptable model plus a method and its state.

    >>> model = AdaptiveModel.load("vit.onnx", method="eva0", seed=0)
    >>> logits = model.step(x)  # predicts and adapts; x: [B, C, H, W] normalised float32

    ``prefetch``: draw the next step's perturbations on a worker thread while ORT runs the
    current one (the same numbers; default: on CUDA only, see
    :class:`~.estimator.ZerothOrderEstimator`).
    """

    def __init__(
        self,
        session: AdaptableSession,
        method: str = "eva0",
        config: dict[str, Any] | None = None,
        seed: int = 0,
        prefetch: bool | None = None,
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
        self.source_stats = (
            (arrays["source_mean"].astype(np.float64), arrays["source_std"].astype(np.float64))
            if self.metadata.has_source_stats
            else None
        )
        self.estimator = ZerothOrderEstimator(
            session, self.config, Objective(self.config, self.source_stats),
            prefetch=session.device == "cuda" if prefetch is None else prefetch,
        )
        self.shift = self._load_shift("activation_shift" in {**fp, **(config or {})})
        self.limits = self._state_limits()
        self.seed = int(seed)
        self.last = StepStats()
        self.asynchronous = False
        self._generation = 0  # counts the jumps of theta that are not steps (see current)
        self.reset()

    def _load_shift(self, asked: bool) -> ActivationShift | None:
        """The activation shift, or None when it is off; a file whose head cannot be shifted
        refuses a shift the user asked for, and runs unshifted (with a warning) when the
        shift came from the file's tuned values (a quantized copy of a tuned file)."""
        cfg = self.config
        if cfg.activation_shift <= 0:
            return None
        try:
            return load_shift(self.session, cfg.activation_shift, cfg.shift_window, cfg.shift_max)
        except HeadError as err:
            if asked:
                raise
            log.warning("%s: activation shift off: %s", self.method, err)
            return None

    def _state_limits(self) -> StateLimits:
        """How far an installed state may be from this model (see :mod:`.statelimits`)."""
        cfg, md = self.config, self.metadata
        theta_radius = max(float(np.sqrt(md.num_params)), cfg.guard_drift_max or 0.0)
        limits = StateLimits(
            md.theta0.astype(np.float32), theta_radius, cfg.eta,
            max(cfg.guard_pause, cfg.guard_warmup) + MAX_PAUSE_BATCH,
        )
        if self.source_stats is not None:
            mean, std = self.source_stats
            energy = float((mean**2 + std**2).sum())
            limits = replace(limits, feature_energy=SCALE_MARGIN**2 * energy)
        if self.shift is not None:
            source = self.shift.source_mean
            scale = SCALE_MARGIN * max(float(np.linalg.norm(source)),
                                       float(np.sqrt(source.size)))
            limits = replace(limits, shift_source=source, shift_square_max=scale**2,
                             shift_radius=scale)
        return limits

    @classmethod
    def load(
        cls, path: str | os.PathLike, method: str = "eva0",
        config: dict[str, Any] | None = None, seed: int = 0, prefetch: bool | None = None,
        **session: Any,
    ) -> AdaptiveModel:
        """Open an adaptable ``.onnx`` file with ONNX Runtime; ``session``: the options of
        :class:`AdaptableSession` (``provider``, ``threads``, ``low_memory``, ``io_binding``)."""
        return cls(AdaptableSession(path, None, **session), method, config, seed, prefetch)

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
        if config.activation_shift < 0 or config.shift_window < 1:
            raise ValueError("need activation_shift >= 0 (0: off) and shift_window >= 1 sample")
        if config.activation_shift > 0 and not self.metadata.has_source_stats:
            raise ValueError("activation_shift needs the model's source statistics (run "
                             "`eva0-edge calibrate`)")
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
        check_budget(self.method, config.budget, fp, config.budget_burst)
        return config

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Back to the source parameters and empty online statistics (same seed)."""
        md = self.metadata
        self.state = AdaptState.initial(md.theta0, md.num_classes, md.num_features, self.seed)
        self._generation += 1
        self._share = AnchorShare(self.config.anchor_per_64)
        self.control = StepController(self)
        self.last = StepStats()

    @property
    def guard(self) -> HealthGuard | None:
        """The health guard (None when off); its windows live in :attr:`control`."""
        return self.control.guard

    @property
    def budget(self) -> ComputeBudget | None:
        """The compute budget (None: adapt on every batch); it lives in :attr:`control`."""
        return self.control.budget

    def set_asynchronous(self, asynchronous: bool = True) -> None:
        """Adapt apart from serving (the asynchronous server): batches are served with
        :meth:`~.controller.StepController.serve_step` and adapted on later by passes
        (:meth:`~.controller.StepController.begin_pass`), so the compute budget charges an
        adapted sample all its #FP forwards beyond the served one. The guard's windows start
        again."""
        self.asynchronous = bool(asynchronous)
        self._sync_state()
        self._install(self.state)

    def freeze(self, frozen: bool = True) -> None:
        """Predict with the current theta and stop adapting (``frozen``), or resume."""
        self.state.frozen = bool(frozen)

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state (arrays and scalars)."""
        self._sync_state()
        return self.state.to_dict()

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Replace the state; shapes are checked before anything changes."""
        state = AdaptState.from_dict(values)
        self._check_state(state)
        self._install(state)

    def state_sizes(self) -> dict[str, int]:
        """Elements of every state array for this model."""
        md = self.metadata
        return {
            "theta": md.num_params, "anchor": md.num_params, "velocity": md.num_params,
            "healthy_theta": md.num_params,
            "center": md.num_classes, "mean": md.num_features, "second_moment": md.num_features,
            "shift_mean": md.num_features,  # at most: the head input is one feature segment
            "shift_recent": md.num_features,
        }

    def _check_state(self, state: AdaptState) -> None:
        """Shapes, then magnitudes against this model (:mod:`.statelimits`)."""
        check_state_sizes(state, self.state_sizes())
        for name in ("shift_mean", "shift_recent"):
            size = getattr(state, name).size
            if self.shift is not None and size not in (0, self.shift.head.width):
                raise StateError(f"state {name} has {size} values; this model's head input "
                                 f"has {self.shift.head.width}")
        self.limits.check(state)

    def _install(self, state: AdaptState) -> None:
        self.state = state
        self._generation += 1
        self.seed = state.seed
        self._share = AnchorShare(self.config.anchor_per_64)
        self._share.credit = state.anchor_credit
        self.control = StepController(self)  # the guard's signal windows warm up again
        if self.budget is not None:
            self.budget.fill = state.budget_fill

    def state_bytes(self) -> bytes:
        """The state as checksummed npz bytes (see :mod:`state`)."""
        self._sync_state()
        return encode_state(self.state, self.fingerprint, {"method": self.method})

    def _sync_state(self) -> None:
        """Copy the running counters that live outside the state into it."""
        self.state.anchor_credit = self._share.credit
        if self.budget is not None:
            self.state.budget_fill = self.budget.fill

    def parse_state_bytes(self, data: bytes) -> AdaptState:
        """Decode and validate state bytes for this model (sizes from the archive headers
        first, checksum, fingerprint, every value and shape) without touching the current
        state, so it may run on any thread; StateError names what is wrong."""
        state, _ = decode_state(data, self.fingerprint, self.state_sizes())
        self._check_state(state)
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
        state, _ = read_state_file(path, self.fingerprint, self.state_sizes())
        self._check_state(state)
        self._install(state)

    # ----------------------------------------------------------------- stats
    @property
    def forwards_per_sample(self) -> float:
        return self.session.counter.per_sample

    def stats(self) -> dict[str, Any]:
        """Counters and health of the adaptation (JSON-serialisable)."""
        counter = self.session.counter
        drift = self.drift()
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
            "activation_shift": None if self.shift is None else {
                "strength": self.shift.strength,
                "samples_weight": self.state.shift_weight,
                "restarts": self.shift.restarts,
                "stream_changes": self.shift.changes,
                "logit_offset_norm": float(np.linalg.norm(self._logit_offset())),
            },
            "budget": None if self.budget is None else self.budget.summary(),
            "guard": None if self.guard is None else {
                "trips": self.state.guard_trips,
                "last_reason": self.guard.last_reason,
                "pause_verdicts": dict(self.guard.verdicts),
                "audits": self.guard.audits,
                "signals": self.guard.values(drift, self.alignment()),
                "bounds": asdict(self.guard.bounds),
            },
        }

    def health(self) -> Health:
        """The counters a server exports (see :class:`~.monitoring.Health`)."""
        st = self.state
        guard = self.guard
        return Health(
            st.step, self.drift(), st.guard_trips, st.clipped_coefs,
            self.spec.adapts and not (st.frozen or st.pause_left > 0),
            guard.audits if guard else 0,
            guard.verdicts["theta0"] + guard.verdicts["hold"] if guard else 0,
        )

    def drift(self) -> float:
        """||theta - theta0||."""
        return float(np.linalg.norm(self.state.theta - self.metadata.theta0))

    def alignment(self) -> float | None:
        """The guard's alignment distance of the online feature moments to the source's (None
        without source statistics or moments yet)."""
        if self.source_stats is None or not self.state.moments_ready:
            return None
        return alignment_distance(self.state.mean, self.state.second_moment, *self.source_stats)

    # ----------------------------------------------------------------- inference
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [B, K] under the current theta, one forward per sample, no adaptation."""
        logits, _ = self._forward(self.session.check_input(x))
        return self._serve(logits)

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits [B, K], features [B, F]) under the current theta on the checked batch x,
        one forward per sample."""
        theta = np.broadcast_to(self.state.theta, (x.shape[0], self.state.theta.size))
        logits, features = self.session.run(x, theta)
        self.session.counter.samples += x.shape[0]
        return logits, features

    def step(self, x: np.ndarray) -> np.ndarray:
        """Predict and (for adapting methods) adapt on the batch; returns logits [B, K]
        (activation-shifted when the shift is on; its test mean learns from the batch unless
        frozen). What happens to the batch is :meth:`~.controller.StepController.step`'s."""
        return self.control.step(x)

    def serve(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """One forward at the current theta on the checked batch x [B, C, H, W]
        (``session.check_input``), served: logits [B, K] (the activation shift learns from the
        batch), and whether the shift's change detector saw a new stream in it."""
        served, features = self.answer(x)
        return served, self.learn_served(features)

    def answer(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`serve` up to the answer: the served logits [B, K] (shifted by what the
        samples before the batch taught the activation shift) and the features [B, F] (owned)
        that :meth:`learn_served` takes once the answer is out, before the next batch."""
        logits, features = self._forward(x)
        return self._serve(logits), self.session.owned(features)

    def learn_served(self, features: np.ndarray) -> bool:
        """The served rows' ``features`` [B, F] enter the activation shift's window; whether
        its change detector saw a new stream in them."""
        if self.shift is None:
            return False
        changes = self.shift.changes
        self.shift.observe(self.state, features)
        return self.shift.changes > changes

    def adapt(self, x: np.ndarray) -> tuple[np.ndarray, bool, np.ndarray | None]:
        """The method's step on the checked batch x [B, C, H, W]: the gradient estimate (one
        ORT call over #FP x B rows, some anchor-guided), its prediction served, then the
        update. Returns the served logits [B, K], whether the shift's change detector saw a
        new stream, and the prediction [B, K] the health guard watches (None: the step was
        skipped, nothing written)."""
        est, n_anchor = self._estimate(x)
        served, shift_changed = self.serve_outputs(est.prediction, est.h_mean)
        self.last.anchor_rows = n_anchor
        return served, shift_changed, self._update(est)

    def begin_served(self, x: np.ndarray) -> ServedPass:
        """Begin the method's step on a checked batch x [B, C, H, W] that was already served
        (the asynchronous server's pass, :attr:`asynchronous`): the perturbed rows now, then
        :meth:`run_served`, then :meth:`finish_served` while the pass is :meth:`current`. As
        :meth:`adapt`, but nothing is served, the activation shift does not see the batch
        again and its samples are not counted again (its rows are)."""
        n_anchor = self._anchor_rows(x.shape[0])
        st = self.state
        prepared = self.estimator.prepare(x, st, self.seed, st.step, n_anchor)
        return ServedPass(x, st, st.step, self._generation, n_anchor, prepared)

    def run_served(self, served: ServedPass) -> tuple[np.ndarray, np.ndarray]:
        """The pass's ORT call over its #FP x B rows: (logits, features). It touches no Python
        state but the forward counter (locked), so it may run on another thread while that
        one serves (when ``session.concurrent_calls``), holding the GIL only to enter ORT."""
        return self.session.run(served.x, served.prepared.rows)

    def current(self, served: ServedPass) -> bool:
        """Whether the state is still the one the pass began on, at the same step: no reset,
        installed state or roll-back since (its estimate is of a theta no longer there)."""
        return served.state is self.state and served.generation == self._generation and \
            served.step == self.state.step

    def finish_served(
        self, served: ServedPass, outputs: tuple[np.ndarray, np.ndarray]
    ) -> np.ndarray | None:
        """The pass's estimate from its ORT call's ``outputs`` and its update; the prediction
        [B, K] the health guard watches, or None when the step is skipped. Only for a
        :meth:`current` pass (the estimate reads the state as it was at its start)."""
        est = self.estimator.combine(served.prepared, *outputs, self.state, control=True)
        self.last.anchor_rows = served.n_anchor
        return self._update(est)

    def _anchor_rows(self, batch: int) -> int:
        """How many of a step's ``batch`` rows are anchor-guided (taken from the share)."""
        return self._share.take(batch) if self.config.sample_wise else 0

    def _estimate(self, x: np.ndarray) -> tuple[GradientEstimate, int]:
        """The step's estimate on x, and how many of its rows were anchor-guided."""
        n_anchor = self._anchor_rows(x.shape[0])
        est = self.estimator.estimate(
            x, self.state, self.seed, self.state.step, n_anchor, control=True
        )
        return est, n_anchor

    def _update(self, est: GradientEstimate) -> np.ndarray | None:
        """The update from ``est``; its prediction, or None when the step is skipped."""
        self.state.step += 1
        if not (np.isfinite(est.coef).all() and np.isfinite(est.grad).all()):
            self._skip("non-finite loss or gradient")
            return None
        if not apply_update(self.config, self.state, est):
            self._skip("non-finite theta")
            return None
        return est.prediction

    def roll_back(self, theta: np.ndarray) -> None:
        """Make ``theta`` [P] both the current and the healthy theta, with no momentum and the
        online statistics started again (they saw the stream that is being left). The
        activation shift's test mean is kept: it follows the input stream, not theta."""
        st = self.state
        self._generation += 1
        st.healthy_theta = theta.astype(np.float32, copy=True)
        st.theta = st.healthy_theta.copy()
        st.velocity = np.zeros_like(st.velocity)
        st.stat_weight = 0.0

    def estimate(self, x: np.ndarray, step_index: int | None = None) -> GradientEstimate:
        """The method's zeroth-order gradient estimate on ``x`` at the current theta, from the
        perturbation stream of ``step_index`` (default: the next step), with no anchor-guided
        rows, no coefficient clipping and no change to the state. One ORT call over #FP x B
        rows."""
        x = self.session.check_input(x)
        index = self.state.step if step_index is None else int(step_index)
        return self.estimator.estimate(x, self.state, self.seed, index, 0, control=False)

    # ----------------------------------------------------------------- internals
    def _logit_offset(self) -> np.ndarray:
        """The activation shift's offset [K] on the logits (zero with the shift off)."""
        if self.shift is None:
            return np.zeros(self.metadata.num_classes)
        return self.shift.offset(self.state)

    def _serve(self, logits: np.ndarray) -> np.ndarray:
        """The logits [B, K] to hand out: shifted by what the samples before this batch
        taught the activation shift. An owned copy, recorded in ``last``."""
        served = self.session.owned(logits)
        if self.shift is not None:
            served = (served + self._logit_offset()).astype(logits.dtype)
        self._record(served)
        return served

    def serve_outputs(
        self, logits: np.ndarray, features: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        """:meth:`_serve`, and whether the shift's change detector saw a new stream in it."""
        return self._serve(logits), self.learn_served(features)

    def _record(self, prediction: np.ndarray) -> None:
        self.last = StepStats.of(prediction)

    def _skip(self, why: str) -> None:
        self.state.skipped += 1
        self.last.skipped = True
        log.warning("step %d skipped: %s", self.state.step, why)
