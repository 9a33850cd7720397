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
:mod:`.rates`, the state and its file format in :mod:`.state`. :class:`Engine` holds the
state and does estimate -> update; it knows nothing of what owns it: what happens to a batch
(serve, adapt, the health guard's duels, the compute budget) and the state's bytes and files
are the :class:`~.policy.Policy`'s.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bank import Memory
from .config import engine_config
from .device_step import DeviceEstimator
from .estimator import GradientEstimate, Objective, PreparedEstimate, ZerothOrderEstimator
from .guard import alignment_distance
from .metadata import ModelMetadata
from .monitoring import Health, StepStats
from .perturbation import AnchorShare
from .registry import REGISTRY, MethodSpec, parse_method
from .served import ServedForward
from .session import AdaptableSession
from .shift import configured_shift
from .state import AdaptState
from .statelimits import state_limits
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
    and that state's step index and generation (see :meth:`Engine.current`) when it
    began, how many of its rows are anchor-guided, and its perturbed rows."""

    x: np.ndarray
    state: AdaptState
    step: int
    generation: int
    n_anchor: int
    prepared: PreparedEstimate


class Engine:
    """An adaptable model plus an EVA-0-family method and its state: config -> estimate ->
    update -> state. What happens to a batch is decided by the :class:`~.policy.Policy` that
    owns it (``load_method`` returns that).

    >>> model = Engine(AdaptableSession("vit.onnx"), method="eva0", seed=0)
    >>> served, shift_changed, prediction = model.adapt(model.session.check_input(x))

    ``prefetch``: draw the next step's perturbations on a worker thread while ORT runs the
    current one (the same numbers; default: on CUDA only, see
    :class:`~.estimator.ZerothOrderEstimator`). A session with ``device_step`` estimates
    on the device instead (:class:`~.device_step.DeviceEstimator`; nothing to prefetch).
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
        self.config = engine_config(self.spec, self.metadata, {**fp, **(config or {})})
        self.fingerprint = model_fingerprint(self.metadata)
        arrays = self.metadata.arrays
        self.source_stats = (
            (arrays["source_mean"].astype(np.float64), arrays["source_std"].astype(np.float64))
            if self.metadata.has_source_stats
            else None
        )
        objective = Objective(self.config, self.source_stats)
        self.estimator = ZerothOrderEstimator(
            session, self.config, objective,
            prefetch=session.device == "cuda" if prefetch is None else prefetch,
        ) if session.cupy is None else DeviceEstimator(session, self.config, objective,
                                                       session.cupy)
        asked = {**fp, **(config or {})}  # the shift the user asked for, which must load
        self.shift = configured_shift(session, self.config, self.method, (
            "activation_shift" if self.config.activation_shift > 0 else "free_shift") in asked)
        self.limits = state_limits(self.config, self.metadata, self.source_stats, self.shift)
        self.forward = ServedForward(session, self.shift)
        self.seed = int(seed)
        self._generation = 0  # counts the jumps of theta that are not steps (see current)
        self._pass_session: AdaptableSession | None = None  # see run_passes_apart
        self.reset()

    @property
    def method(self) -> str:
        return self.spec.name

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Back to the source parameters and empty online statistics (same seed)."""
        md = self.metadata
        self.state = AdaptState.initial(md.theta0, md.num_classes, md.num_features, self.seed)
        self._generation += 1
        self._share = AnchorShare(self.config.anchor_per_64)
        self.forward.last = StepStats()

    @property
    def last(self) -> StepStats:
        """What the last batch handed out was (entropy, norm, skipped, anchor rows)."""
        return self.forward.last

    @property
    def frozen(self) -> bool:
        return self.state.frozen

    def freeze(self, frozen: bool = True) -> None:
        """Predict with the current theta and stop adapting (``frozen``), or resume. A freeze
        ends every pass begun before it (:meth:`current`), even one whose freeze is lifted
        before it finishes."""
        if frozen and not self.state.frozen:
            self._generation += 1
        self.state.frozen = bool(frozen)

    def install(self, state: AdaptState) -> None:
        """Make ``state``, checked against :attr:`limits` (sizes and bounds), the model's."""
        self.state = state
        self._generation += 1
        self.seed = state.seed
        self._share = AnchorShare(self.config.anchor_per_64)
        self._share.credit = state.anchor_credit

    def sync_state(self) -> None:
        """Copy the anchor share's running credit, which lives outside the state, into it."""
        self.state.anchor_credit = self._share.credit

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters and health of the adaptation (JSON-serialisable; the policy adds the
        budget's and the guard's)."""
        counter = self.session.counter
        return {
            "method": self.method,
            "steps": self.state.step,
            "skipped_steps": self.state.skipped,
            "samples": counter.samples,
            "forwards": counter.forwards,
            "forwards_per_sample": counter.per_sample,
            "clipped_coefficients": self.state.clipped_coefs,
            "clipped_steps": self.state.clipped_steps,
            "drift": self.drift(),
            "mean_entropy": self.last.entropy,
            "mean_logit_norm": self.last.logit_norm,
            "frozen": self.state.frozen,
            "paused_samples_left": self.state.pause_left,
            "activation_shift": None if self.shift is None else self.shift.summary(self.state),
        }

    def health(self) -> Health:
        """The counters a server exports (see :class:`~.monitoring.Health`; the guard's audits
        and verdicts are the policy's)."""
        st = self.state
        return Health(st.step, self.drift(), st.guard_trips, st.clipped_coefs,
                      self.spec.adapts and not (st.frozen or st.pause_left > 0))

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
        logits, _ = self.forward.run(self.session.check_input(x), self.state.theta)
        return self.forward.hand_out(logits, self.state)

    def serve(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """One forward at the current theta on the checked batch x [B, C, H, W]
        (``session.check_input``), served: logits [B, K] (the activation shift learns from the
        batch), and whether the shift's change detector saw a new stream in it."""
        return self.serve_outputs(*self.forward.run(x, self.state.theta))

    def answer(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`serve` without the learning: the served logits [B, K] and the features [B, F]
        (owned) for :meth:`learn_served`."""
        logits, features = self.forward.run(x, self.state.theta)
        return self.forward.hand_out(logits, self.state), self.session.owned(features)

    def learn_served(self, features: np.ndarray) -> bool:
        """The served rows' ``features`` [B, F] enter the shift's window (see :mod:`.served`)."""
        return self.forward.learn(self.state, features)

    def serve_outputs(
        self, logits: np.ndarray, features: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        """Hand out ``logits`` [B, K], then learn from ``features`` [B, F] (:mod:`.served`)."""
        return self.forward.hand_out(logits, self.state), self.forward.learn(self.state, features)

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
        (the asynchronous server's :class:`~.policy.AdaptationPass`): the perturbed rows now,
        then their ORT call, then :meth:`finish_served` while the pass is :meth:`current`. As
        :meth:`adapt`, but nothing is served, the activation shift does not see the batch
        again and its samples are not counted again (its rows are)."""
        n_anchor = self._anchor_rows(x.shape[0])
        st = self.state
        prepared = self.estimator.prepare(x, st, self.seed, st.step, n_anchor)
        return ServedPass(x, st, st.step, self._generation, n_anchor, prepared)

    def current(self, served: ServedPass) -> bool:
        """Whether the state is still the one the pass began on, at the same step: no reset,
        installed state or roll-back since (its estimate is of a theta no longer there)."""
        return served.state is self.state and served.generation == self._generation and \
            served.step == self.state.step

    def run_passes_apart(self) -> None:
        """Run the passes' ORT calls (:meth:`run_served`) on a single-threaded session
        (:meth:`~.session.AdaptableSession.single_threaded`), so that a pass on another thread
        runs on that thread alone (opened once)."""
        if self._pass_session is None:
            self._pass_session = self.session.single_threaded()

    def run_served(self, served: ServedPass) -> tuple[np.ndarray, np.ndarray]:
        """The pass's ORT call over its prepared rows: (logits, features). It writes no
        state, so it may run on another thread. The rows themselves are drawn by
        :meth:`begin_served`, on the thread that owns the state: drawn on the pass thread,
        whose lowest priority then holds the GIL the answers wait for, they took the shipped
        ResNet-GN's one-client p99 from 4.6-5.5 ms to 4.8-8.5 ms
        (``results/serve-tail/single-threaded-pass``)."""
        if self._pass_session is None:
            return self.estimator.run(served.x, served.prepared)
        return self._pass_session.run(served.x, served.prepared.rows)

    def estimate_served(
        self, served: ServedPass, outputs: tuple[np.ndarray, np.ndarray]
    ) -> GradientEstimate:
        """The pass's estimate from its ORT call's ``outputs`` (logits, features). It only
        reads the state the pass began on, and what it reads there (the target moments, the
        output centre, the coefficients' running scale) only a step writes, so it may run on
        the pass's thread: a step or a roll-back in between makes the pass not
        :meth:`current` and :meth:`finish_served` is never called with it."""
        return self.estimator.combine(served.prepared, *outputs, served.state, control=True)

    def finish_served(self, served: ServedPass, est: GradientEstimate) -> np.ndarray | None:
        """The pass's update from its estimate (:meth:`estimate_served`); the prediction
        [B, K] the health guard watches, or None when the step is skipped. Only for a
        :meth:`current` pass."""
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

    def segment_memory(self, key: np.ndarray, samples: float) -> Memory:
        """What the state holds of the stream segment now ending, for the domain bank: theta,
        the feature moments and the activation shift's long window (zeros of the head input's
        width while empty; none without a shift), under ``key`` [6] (the segment's input
        descriptors) and its length ``samples``."""
        st = self.state
        width = 0 if self.shift is None else self.shift.head.width
        weight = st.shift_weight if st.shift_mean.size == width else 0.0
        classes = st.center.size if self.shift is not None and \
            self.shift.corrects_label_shift else 0
        mix = st.shift_classes.copy() if weight and st.shift_classes.size == classes else \
            np.full(classes, 1.0 / max(classes, 1))
        return Memory(
            key=key.copy(), theta=st.theta.copy(),
            shift_mean=st.shift_mean.copy() if weight else np.zeros(width),
            moments=np.concatenate([st.center, st.mean, st.second_moment]),
            shift_sq=st.shift_sq if weight else 0.0, shift_weight=weight,
            stat_weight=st.stat_weight, last_used=0.0, samples=float(samples),
            shift_classes=mix,
        )

    def recall(self, memory: Memory) -> None:
        """Make a domain bank's ``memory`` the state: its theta current and healthy, no
        momentum, its moments, and its shift window as the long one (the short window refills;
        the offset is served at once). No forward runs."""
        st = self.state
        self._generation += 1
        st.theta = memory.theta.astype(np.float32, copy=True)
        st.healthy_theta = st.theta.copy()
        st.velocity = np.zeros_like(st.velocity)
        classes, features = st.center.size, st.mean.size
        st.center = memory.moments[:classes].copy()
        st.mean = memory.moments[classes:classes + features].copy()
        st.second_moment = memory.moments[classes + features:].copy()
        st.stat_weight = memory.stat_weight
        if self.shift is not None and memory.shift_weight > 0:
            st.shift_mean, st.shift_sq = memory.shift_mean.copy(), memory.shift_sq
            st.shift_classes = memory.shift_classes.copy()
            st.shift_weight = memory.shift_weight
            st.shift_recent_weight = 0.0

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

    def _skip(self, why: str) -> None:
        self.state.skipped += 1
        self.last.skipped = True
        log.warning("step %d skipped: %s", self.state.step, why)
