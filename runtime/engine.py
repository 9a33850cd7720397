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
:mod:`.rates`, the state and its file format in :mod:`.state`, the health guard in :mod:`.guard`.
:class:`AdaptiveModel` orchestrates them and owns the state.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from .budget import ComputeBudget
from .config import AdaptConfig
from .estimator import GradientEstimate, Objective, ZerothOrderEstimator
from .guard import GuardBounds, HealthGuard, alignment_distance
from .head import HeadError
from .inputwatch import InputChangeDetector
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
        self._source_stats = (
            (arrays["source_mean"].astype(np.float64), arrays["source_std"].astype(np.float64))
            if self.metadata.has_source_stats
            else None
        )
        self.estimator = ZerothOrderEstimator(
            session, self.config, Objective(self.config, self._source_stats),
            prefetch=session.device == "cuda" if prefetch is None else prefetch,
        )
        self.shift = self._load_shift("activation_shift" in {**fp, **(config or {})})
        self.limits = self._state_limits()
        self.seed = int(seed)
        self.last = StepStats()
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
        if self._source_stats is not None:
            mean, std = self._source_stats
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
        if config.budget is not None and not 1 <= config.budget <= fp:
            raise ValueError(f"{self.method}: budget must be between 1 and the method's {fp} "
                             f"forwards per sample (None: {fp}), got {config.budget}")
        return config

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Back to the source parameters and empty online statistics (same seed)."""
        md = self.metadata
        self.state = AdaptState.initial(md.theta0, md.num_classes, md.num_features, self.seed)
        self._share = AnchorShare(self.config.anchor_per_64)
        self.guard = self._new_guard()
        self.inputs = InputChangeDetector()
        self.budget = self._new_budget()
        self.last = StepStats()

    def _new_guard(self) -> HealthGuard | None:
        cfg = self.config
        if not (cfg.guard and self.spec.adapts):
            return None
        bounds = GuardBounds(**{
            name: getattr(cfg, f"guard_{name}") for name in GuardBounds.__dataclass_fields__
        })
        return HealthGuard(bounds, cfg.guard_window, cfg.guard_warmup, cfg.guard_checkpoint,
                           self._source_stats, cfg.guard_audit_margin, cfg.guard_change_margin)

    def _new_budget(self) -> ComputeBudget | None:
        """The compute budget, or None when the method adapts on every batch."""
        cfg = self.config
        if not self.spec.adapts or cfg.budget is None or cfg.budget >= cfg.forwards:
            return None
        return ComputeBudget(cfg.budget, cfg.forwards)

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
        self.seed = state.seed
        self._share = AnchorShare(self.config.anchor_per_64)
        self._share.credit = state.anchor_credit
        self.guard = self._new_guard()  # the signal windows warm up again
        self.budget = self._new_budget()
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
            "activation_shift": None if self.shift is None else {
                "strength": self.shift.strength,
                "samples_weight": self.state.shift_weight,
                "restarts": self.shift.restarts,
                "stream_changes": self.shift.changes,
                "logit_offset_norm": float(np.linalg.norm(self._logit_offset())),
            },
            "budget": None if self.budget is None else {
                "forwards_per_sample": self.budget.budget,
                "fill": self.budget.fill,
                "adapted_samples": self.budget.adapted_samples,
                "served_samples": self.budget.served_samples,
            },
            "guard": None if self.guard is None else {
                "trips": self.state.guard_trips,
                "last_reason": self.guard.last_reason,
                "pause_verdicts": dict(self.guard.verdicts),
                "audits": self.guard.audits,
                "signals": self.guard.values(drift, self._alignment()),
                "bounds": asdict(self.guard.bounds),
            },
        }

    def health(self) -> Health:
        """The counters a server exports (see :class:`~.monitoring.Health`)."""
        st = self.state
        guard = self.guard
        return Health(
            st.step, self._drift(), st.guard_trips, st.clipped_coefs,
            self.spec.adapts and not (st.frozen or st.pause_left > 0),
            guard.audits if guard else 0,
            guard.verdicts["theta0"] + guard.verdicts["hold"] if guard else 0,
        )

    def _drift(self) -> float:
        return float(np.linalg.norm(self.state.theta - self.metadata.theta0))

    def _alignment(self) -> float | None:
        if self._source_stats is None or not self.state.moments_ready:
            return None
        return alignment_distance(self.state.mean, self.state.second_moment, *self._source_stats)

    # ----------------------------------------------------------------- inference
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [B, K] under the current theta, one forward per sample, no adaptation."""
        logits, _ = self._forward(x)
        return self._serve(logits)

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits [B, K], features [B, F]) under the current theta, one forward per sample."""
        x = self.session.check_input(x)
        theta = np.broadcast_to(self.state.theta, (x.shape[0], self.state.theta.size))
        logits, features = self.session.run(x, theta)
        self.session.counter.samples += x.shape[0]
        return logits, features

    def step(self, x: np.ndarray) -> np.ndarray:
        """Predict and (for adapting methods) adapt on the batch; returns logits [B, K]
        (activation-shifted when the shift is on; its test mean learns from the batch unless
        frozen)."""
        if not self.spec.adapts:
            if self.shift is None or self.state.frozen:
                return self.predict(x)
            logits, features = self._forward(x)
            return self._serve(logits, features)
        if self.state.pause_left > 0 and not self.state.frozen and self.guard is not None:
            return self._paused_step(self.guard, x)
        if self.state.frozen or self.state.pause_left > 0:
            logits = self.predict(x)
            self.state.pause_left = max(0, self.state.pause_left - logits.shape[0])
            return logits
        x = self.session.check_input(x)
        inputs_changed = self._inputs_changed(x)
        if self.budget is not None and not self.budget.adapt(x.shape[0]):
            return self._serve_only(x, inputs_changed)
        n_anchor = self._share.take(x.shape[0]) if self.config.sample_wise else 0
        est = self.estimator.estimate(
            x, self.state, self.seed, self.state.step, n_anchor, control=True
        )
        served, shift_changed = self._serve_watched(est.prediction, est.h_mean)
        stream_changed = inputs_changed or shift_changed
        self.last.anchor_rows = n_anchor
        self.state.step += 1
        if not (np.isfinite(est.coef).all() and np.isfinite(est.grad).all()):
            return self._skip(served, "non-finite loss or gradient")
        if not apply_update(self.config, self.state, est):
            return self._skip(served, "non-finite theta")
        if self.guard is not None:
            self._watch(self.guard, est.prediction)
        self._after_change(stream_changed)
        return served

    def _serve_only(self, x: np.ndarray, inputs_changed: bool) -> np.ndarray:
        """A batch the budget does not adapt on: one forward at the current theta, served
        (the activation shift learns from it)."""
        logits, features = self._forward(x)
        served, shift_changed = self._serve_watched(logits, features)
        self._after_change(inputs_changed or shift_changed)
        return served

    def _after_change(self, stream_changed: bool) -> None:
        """After a batch: on a new stream (seen in the images or by the shift's change
        detector) the budget spends densely, and an audit asks whether what was learnt is
        still better than theta0 there (frost-adapted ViT on clean images: 63% of the first
        100); the guard's periodic audit otherwise when due."""
        if stream_changed and self.budget is not None:
            self.budget.changed()
        guard = self.guard
        if guard is None or self.state.pause_left:
            return
        now = stream_changed and self.config.guard_change_audit and \
            not np.array_equal(self.state.theta, self.metadata.theta0)
        if not self._affords_duel(guard.warmup):
            if now:  # the audit at a change the credit cannot pay for: theta0 wins it
                self._lose_duel("the audit at a change of stream")
            return  # a periodic audit waits for the credit
        if guard.start_audit(self.config.guard_audit, now):
            self.state.pause_left = guard.warmup

    def _affords_duel(self, samples: int) -> bool:
        """Whether the budget's credit pays a duel of the guard over ``samples`` samples (one
        forward each beyond the served one); always True without a budget."""
        return self.budget is None or self.budget.credit >= samples

    def _lose_duel(self, what: str) -> None:
        """A duel the budget cannot pay for is not run: the candidate gives way to theta0, the
        side every duel falls back to (served with one forward per sample)."""
        log.info("compute budget: %s cannot be paid for (credit %.0f forwards); theta0 serves",
                 what, self.budget.credit if self.budget is not None else 0.0)
        self._roll_back(self.metadata.theta0)

    def _inputs_changed(self, x: np.ndarray) -> bool:
        """Feed the input change detector (with the guard on) the images x [B, C, H, W]; on a
        change the activation shift's window restarts too (it holds the old stream's head
        inputs: the ViT's, after Gaussian noise, moved clean images by the noise's offset
        for a window's length)."""
        if (self.guard is None and self.budget is None) or not self.inputs.observe(x):
            return False
        if self.shift is not None:
            self.shift.restart(self.state)
        return True

    def _watch(self, guard: HealthGuard, prediction: np.ndarray) -> None:
        """Feed the health guard; checkpoint when healthy, roll back when it trips."""
        reason, checkpoint = guard.observe(prediction, self._drift(), self._alignment())
        st = self.state
        if checkpoint:
            st.healthy_theta = st.theta.copy()
        if reason is None:
            return
        to_source = guard.tripped(reason)
        if self.budget is not None:
            self.budget.changed()
        if to_source or self._affords_duel(self.config.guard_pause) or \
                np.array_equal(st.healthy_theta, self.metadata.theta0):
            self._roll_back(self.metadata.theta0 if to_source else st.healthy_theta)
        else:
            to_source = True
            self._lose_duel("the pause's duel of the last healthy theta")
        st.guard_trips += 1
        st.pause_left = self.config.guard_pause
        log.warning(
            "health guard tripped at step %d: %s; rolled back to %s, adaptation paused for "
            "%d samples", st.step, reason, "theta0" if to_source else "the last healthy theta",
            st.pause_left,
        )

    def _paused_step(self, guard: HealthGuard, x: np.ndarray) -> np.ndarray:
        """One batch of the guard's pause: the candidate theta and theta0 in one ORT call (one
        forward per sample when the candidate is theta0), theta0's logits [B, K] served; at
        the end of the pause, the guard's verdict picks where adaptation resumes."""
        x = self.session.check_input(x)
        inputs_changed = self._inputs_changed(x)
        st, batch = self.state, x.shape[0]
        theta0 = self.metadata.theta0.astype(np.float32)
        dueled = not np.array_equal(st.theta, theta0)
        sides = np.stack([st.theta, theta0]) if dueled else st.theta[None]
        logits, features = self.session.run(x, np.repeat(sides, batch, axis=0))
        self.session.counter.samples += batch
        if dueled and self.budget is not None:
            self.budget.charge(batch)
        rows = slice(0, batch) if guard.serving_candidate or not dueled else slice(batch, None)
        served, shift_changed = self._serve_watched(logits[rows], features[rows])
        if inputs_changed or shift_changed:
            # the verdict is about the stream that follows: judge it on that stream alone
            guard.restart_windows()
            st.pause_left = max(st.pause_left, guard.warmup + batch)
        guard.observe_pause(logits, features, dueled)
        st.pause_left = max(0, st.pause_left - batch)
        if st.pause_left == 0:
            self._end_pause(guard, dueled)
        return served

    def _end_pause(self, guard: HealthGuard, dueled: bool) -> None:
        st, cfg = self.state, self.config
        at_change = guard.auditing and not guard.serving_candidate
        what = "audit" if guard.auditing else "pause"
        margin = guard.duel_margin
        held = guard.holding
        verdict = guard.pause_verdict(dueled, min(guard.warmup, cfg.guard_pause))
        if held and verdict != "hold" and self.shift is not None:
            self.shift.restart(st)  # its windows saw a stream theta0 fails on
        keep = verdict == "checkpoint" or (verdict == "hold" and guard.hold_candidate)
        kept = "the duelled theta"
        if dueled and not keep:
            self._roll_back(self.metadata.theta0)
        elif dueled and verdict == "hold" and what == "audit" and (at_change or (
                self.shift is not None and self.shift.degenerate(st))):
            # an audit duels the current theta, which adapted on the stream: at a change of
            # stream it took its last steps on a stream theta0 fails on, and on one with no
            # spread (black frames, noise) that is no learning to keep, so keep the last
            # checkpoint taken while the signals were in bounds (the ResNet-GN kept a theta
            # 4.3 from theta0 after 3 steps on black frames); on a corruption theta0 fails
            # too (fog) met by a periodic audit, what the current theta learnt is kept
            self._roll_back(st.healthy_theta)
            kept = "the last healthy checkpoint"
        if verdict == "hold":
            st.pause_left = cfg.guard_pause
            if keep and dueled and not self._affords_duel(st.pause_left):
                self._lose_duel("the next duel of the hold")
                keep = False
        elif self.budget is not None:
            self.budget.changed()
        # routine: a hold at theta0, an audit that keeps theta, any verdict of an audit at a
        # change of stream (every corruption of a continual stream starts one)
        quiet = (verdict == "hold" and not dueled) or (what, verdict) == ("audit", "checkpoint") \
            or at_change
        hold = f"serving theta0 and keeping {kept} for the next duel" if keep else \
            "holding at theta0"
        log.log(logging.INFO if quiet else logging.WARNING,
                "health guard: after the %s at step %d (alignment %s vs theta0's %s), %s",
                f"{what} at a change of stream" if at_change else what, st.step,
                *(f"{d:.4g}" if d is not None else "-" for d in guard.last_duel), {
            "checkpoint": "adaptation goes on from the duelled theta (in bounds, and not "
                          f"over {margin}x theta0's distance to the source)",
            "theta0": "adaptation resumes from theta0",
            "hold": f"theta0's own signals are out of bounds (the stream is to blame): {hold} for "
                    f"{cfg.guard_pause} more samples",
        }[verdict])

    def _roll_back(self, theta: np.ndarray) -> None:
        """Make ``theta`` [P] both the current and the healthy theta, with no momentum and the
        online statistics started again (they saw the stream that is being left). The
        activation shift's test mean is kept: it follows the input stream, not theta."""
        st = self.state
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

    def _serve(self, logits: np.ndarray, features: np.ndarray | None = None) -> np.ndarray:
        """The logits [B, K] to hand out: shifted by what the samples before this batch
        taught the activation shift; then ``features`` [B, F] (the served rows', None: no
        update) enter the shift's window. An owned copy, recorded in ``last``."""
        served = self.session.owned(logits)
        if self.shift is not None:
            served = (served + self._logit_offset()).astype(logits.dtype)
            if features is not None:
                self.shift.observe(self.state, features)
        self._record(served)
        return served

    def _serve_watched(self, logits: np.ndarray, features: np.ndarray) -> tuple[np.ndarray, bool]:
        """:meth:`_serve`, and whether the shift's change detector saw a new stream in it."""
        changes = self.shift.changes if self.shift is not None else 0
        served = self._serve(logits, features)
        return served, self.shift is not None and self.shift.changes > changes

    def _record(self, prediction: np.ndarray) -> None:
        self.last = StepStats.of(prediction)

    def _skip(self, prediction: np.ndarray, why: str) -> np.ndarray:
        self.state.skipped += 1
        self.last.skipped = True
        log.warning("step %d skipped: %s", self.state.step, why)
        return prediction
