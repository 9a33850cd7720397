"""What happens to a batch: the policy that owns an adapting model (NumPy only).

:meth:`Policy.step` decides, per batch x [B, C, H, W], in this order (for the EVA-0 family
and, without a guard, FOA: :class:`~.foa.FOAModel` has the same ``serve`` / ``adapt`` /
``predict``):

1. **the one-forward tier** (a method that does not adapt: NoAdapt, noadapt-shift; or an
   adapting one at ``budget`` 1): one forward at theta, served (the activation shift learns
   from it unless frozen); noadapt-shift takes eva0's tuned shift, so it and eva0 at
   ``--budget 1`` are one computation, bit for bit;
2. **the health guard's pause or audit**: the candidate theta and theta0 duel in one ORT call
   (one forward per sample when the candidate is theta0), theta0 or the candidate served; at
   its end the guard's verdict (checkpoint / theta0 / hold) says where adaptation resumes;
3. **frozen** (or paused without a guard): one forward at theta, served;
4. **the compute budget says wait** (:mod:`.budget`): one forward at theta, served, the
   activation shift learning from it;
5. **adapt**: the method's step (:meth:`~.engine.Engine.adapt`: estimate, then update),
   then the guard watches the prediction (checkpoint when healthy, roll back and pause when it
   trips).

The asynchronous server splits this in two: :meth:`Policy.serve_step` answers (steps 1-4,
the budget earning the batch's credit; batches under ``LEARN_BLOCK`` rows are learnt from in
blocks, :meth:`Policy.learn`), and an adaptation pass runs step 5 on batches already
answered, when the worker is idle and the credit pays for it: :meth:`Policy.begin_pass` (the
checks, the budget, the perturbed rows) hands out an :class:`AdaptationPass`, whose ORT call
(:meth:`AdaptationPass.run`) may run on another thread while serving goes on, and whose
:meth:`AdaptationPass.finish` does the estimate, the update and the guard (dropped when a
roll-back, reset, installed state, pause or freeze came in between).

After steps 4 and 5, a change of stream (the input change detector, the activation shift's
change detector) makes the budget spend densely and starts the guard's audit at a change; the
guard's periodic audit starts when due. A duel runs only when the budget's credit pays for it;
one it cannot pay for is not run and theta0 serves (:meth:`Policy._lose_duel`).

The policy owns the model; the engine (:class:`~.engine.Engine`) holds the state and
does estimate -> update and knows nothing of the policy. This module owns the guard, the
budget, the input change detector and the state's bytes and files. Every path a batch can
take: ``docs/design/batch.md``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .bank import MIN_SEGMENT_SAMPLES, DomainBank
from .budget import ComputeBudget
from .guard import GuardBounds, HealthGuard
from .inputwatch import DESCRIPTORS, RECENT_SAMPLES, InputChangeDetector
from .metadata import ModelMetadata
from .monitoring import Health, StepStats
from .registry import RUNTIME_KINDS, MethodSpec, spec_of
from .session import AdaptableSession
from .shift import ActivationShift
from .state import (
    AdaptState,
    StateMismatch,
    decode_state,
    encode_state,
    read_state_file,
    write_state_file,
)

if TYPE_CHECKING:
    from .engine import Engine, ServedPass
    from .estimator import GradientEstimate
    from .foa import FOAModel

log = logging.getLogger(__name__)

# The fewest served rows the asynchronous server learns from at once (serve_step)
LEARN_BLOCK = 8
# The domain bank looks a new segment up at the change itself from the last CHANGE_ROWS images
# (the batch's, when it holds as many), then from the detector's recent window once full
CHANGE_ROWS = 8


def _use_in_words(info: dict) -> str:
    """``"eva0 (synchronous, budget 1.5)"``: a state's or a server's use (:meth:`Policy._use`),
    as much of it as ``info`` records."""
    details = []
    if isinstance(info.get("asynchronous"), bool):
        details.append("asynchronous" if info["asynchronous"] else "synchronous")
    if "budget" in info:
        budget = info["budget"]
        if budget is None:
            details.append("no budget")
        elif isinstance(budget, (int, float)):
            details.append(f"budget {budget:g}")
        else:
            details.append(f"budget {budget!r:.20}")
    method = info.get("method")
    if method is None:
        name = "a method it does not name"
    else:
        name = method if isinstance(method, str) else f"{method!r:.40}"
    return name + (f" ({', '.join(details)})" if details else "")


class AdaptationPass:
    """One asynchronous adaptation pass on a batch already answered, handed out by
    :meth:`Policy.begin_pass` on the thread that owns the state: :meth:`run` (its ORT call over
    #FP x B rows) may run on any thread while serving goes on, :meth:`finish` (the estimate,
    the update and the guard) runs on the owning thread again."""

    def __init__(self, policy: Policy, model: Engine, served: ServedPass) -> None:
        self._policy = policy
        self._model = model
        self.served = served

    @property
    def rows(self) -> int:
        """The samples the pass adapts on."""
        return int(self.served.x.shape[0])

    def run(self) -> GradientEstimate:
        """The pass's ORT call (:meth:`call`) and the estimate from it (:meth:`estimate`), on
        the calling thread."""
        return self.estimate(self.call())

    def call(self) -> tuple[np.ndarray, np.ndarray]:
        """The pass's ORT call over its #FP x B perturbed rows (:meth:`Engine.run_served`): the
        logits and features. It writes no Python state but the forward counter (locked), so it
        may run on another thread while that one serves (when ``session.concurrent_calls``),
        and it holds the GIL only to enter and leave ORT."""
        return self._model.run_served(self.served)

    def estimate(self, outputs: tuple[np.ndarray, np.ndarray]) -> GradientEstimate:
        """The losses and the gradient from :meth:`call`'s ``outputs``
        (:meth:`Engine.estimate_served`): NumPy that reads only what a step writes, so it too
        may run on another thread; the serving thread then waits only for :meth:`finish`."""
        return self._model.estimate_served(self.served, outputs)

    def finish(self, est: GradientEstimate) -> bool:
        """The update from :meth:`run`'s estimate, then the guard watches the step's
        prediction. A pass the state moved away from since it began (a roll-back, a reset, a
        state installed) or begun before a pause or a freeze is dropped: its forwards were
        spent, nothing is written. Returns whether the step ran."""
        return self._policy._finish_pass(self.served, est)


class Policy:
    """An adapting model as it is used: the method's model (the EVA-0-family engine
    :class:`~.engine.Engine` or :class:`~.foa.FOAModel`) with its health guard, compute
    budget and input change detector, the order in which they act on a batch (see the module's
    docstring), and the model's state as bytes and files. What the method can do (keep a
    state, run the guard, adapt apart from serving) is its registry entry's
    (:class:`~.registry.MethodSpec`). ``guard`` and ``budget`` are None when off; they and the
    detector start afresh on a reset or an installed state.

    >>> policy = Policy.load("vit.onnx", "eva0", seed=0)
    >>> logits = policy.step(x)  # predicts and adapts; x: [B, C, H, W] normalised float32
    """

    def __init__(self, model: Engine | FOAModel) -> None:
        self.model = model
        self.asynchronous = False
        self._restart()

    @classmethod
    def load(
        cls, path: str | os.PathLike, method: str = "eva0",
        config: dict[str, Any] | None = None, seed: int = 0, **session: Any,
    ) -> Policy:
        """Open an adaptable ``.onnx`` file under ``method`` (any runtime method, ``@FP``
        allowed); ``session``: the options of :class:`~.session.AdaptableSession`, and
        ``prefetch`` for the EVA-0 family (see :class:`~.engine.Engine`)."""
        from .engine import Engine
        from .foa import FOAModel

        prefetch = session.pop("prefetch", None)
        opened = AdaptableSession(path, None, **session)
        if spec_of(method, *RUNTIME_KINDS).kind == "foa":
            return cls(FOAModel(opened, method, config, seed))
        return cls(Engine(opened, method, config, seed, prefetch))

    def _restart(self) -> None:
        """New guard, budget and input change detector windows (a reset, a state installed)."""
        self.guard = self._new_guard()
        self.budget = self._new_budget()
        self.inputs = InputChangeDetector()
        # served batches not learnt from yet (serve_step): their checked images and features
        self._waiting: list[tuple[np.ndarray, np.ndarray]] = []
        self.bank = self._read_bank()
        self._segment_slot: int | None = None  # the bank slot the current segment came from
        self._segment_samples = 0
        self._recall_due = True  # look the segment up once the detector's window is full
        self._known_change = False  # the change of this batch was recalled from the bank
        self._last_rows = np.zeros((0, len(DESCRIPTORS)))  # the last images' descriptors

    def _engine(self) -> Engine:
        """The model as the EVA-0-family engine: what the health guard, its duels, the state
        and the asynchronous server act on (its registry entry says it keeps a state)."""
        if not self.spec.keeps_state:
            raise TypeError(f"{self.method}: the health guard, the state and asynchronous "
                            "adaptation need an EVA-0-family method")
        return cast("Engine", self.model)

    def _new_guard(self) -> HealthGuard | None:
        if not self.spec.guard or self.one_forward:
            return None
        m = self._engine()
        cfg = m.config
        if not cfg.guard:
            return None
        bounds = GuardBounds(**{
            name: getattr(cfg, f"guard_{name}") for name in GuardBounds.__dataclass_fields__
        })
        return HealthGuard(bounds, cfg.guard_window, cfg.guard_warmup, cfg.guard_checkpoint,
                           m.source_stats, cfg.guard_audit_margin, cfg.guard_change_margin)

    def _read_bank(self) -> DomainBank | None:
        """The domain bank the state holds (``bank_slots`` > 0 and an adapting EVA-0-family
        method), or None."""
        slots = getattr(self.model.config, "bank_slots", 0)
        if not slots or self.one_forward or not self.spec.keeps_state:
            return None
        m = self._engine()
        width = 0 if m.shift is None else m.shift.head.width
        return DomainBank.read(m.state, slots, m.config.bank_threshold, width)

    def _new_budget(self) -> ComputeBudget | None:
        """The compute budget, or None when the method adapts on every batch."""
        cfg = self.model.config
        # adapting apart from serving, an adapted sample costs #FP + 1 forwards: F = #FP
        # still leaves some samples unadapted
        unbounded = cfg.forwards + 1 if self.asynchronous else cfg.forwards
        if self.one_forward or cfg.budget is None or cfg.budget >= unbounded:
            return None
        return ComputeBudget(cfg.budget, cfg.forwards, self.asynchronous, cfg.budget_burst)

    # ----------------------------------------------------------------- the model
    @property
    def one_forward(self) -> bool:
        """Whether every batch is served with one forward at theta and nothing adapts: a
        method that does not adapt, or an adapting EVA-0-family one at ``budget`` 1 (no guard,
        no budget then: theta never moves; another method at budget 1 keeps its budget, which
        serves the batches it does not adapt on)."""
        budget = getattr(self.model.config, "budget", None)
        return not self.spec.adapts or (
            self.spec.keeps_state and budget is not None and budget <= 1)

    @property
    def spec(self) -> MethodSpec:
        return self.model.spec

    @property
    def method(self) -> str:
        return self.model.method

    @property
    def metadata(self) -> ModelMetadata:
        return self.model.metadata

    @property
    def session(self) -> AdaptableSession:
        return self.model.session

    @property
    def config(self) -> Any:
        """The method's hyper-parameters (:class:`~.config.AdaptConfig` or FOA's)."""
        return self.model.config

    @property
    def state(self) -> AdaptState:
        return self._engine().state

    @property
    def fingerprint(self) -> str:
        return self._engine().fingerprint

    @property
    def shift(self) -> ActivationShift | None:
        return self.model.shift

    @property
    def last(self) -> StepStats:
        """What the last batch's served logits were (entropy, norm, skipped)."""
        return self.model.last

    @property
    def forwards_per_sample(self) -> float:
        return self.session.counter.per_sample

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [B, K] under the current parameters, one forward per sample, no adaptation."""
        return self.model.predict(x)

    def freeze(self, frozen: bool = True) -> None:
        """Predict with the current parameters and stop adapting (``frozen``), or resume."""
        self.model.freeze(frozen)

    def reset(self) -> None:
        """Back to the source parameters, empty online statistics and fresh windows."""
        self.model.reset()
        self._restart()

    def set_asynchronous(self, asynchronous: bool = True) -> None:
        """Adapt apart from serving (the asynchronous server): batches are served with
        :meth:`serve_step` and adapted on later by passes (:meth:`begin_pass`), so the compute
        budget charges an adapted sample all its #FP forwards beyond the served one. The
        guard's windows start again."""
        if not self.spec.separate_step:
            raise ValueError(f"asynchronous adaptation runs the method's step apart from "
                             f"serving; {self.method} adapts only in its own step")
        self.asynchronous = bool(asynchronous)
        if self.asynchronous and self.session.concurrent_calls:  # passes on their own thread
            self._engine().run_passes_apart()
        self._sync_state()
        self._install(self.state)

    def stats(self) -> dict[str, Any]:
        """Counters and health of the adaptation (JSON-serialisable)."""
        stats = {**self.model.stats(),
                 "budget": None if self.budget is None else self.budget.summary(),
                 "bank": None if self.bank is None else self.bank.summary()}
        if not self.spec.guard:
            return stats
        m = self._engine()
        guard = self.guard
        stats["guard"] = None if guard is None else {
            "trips": m.state.guard_trips,
            "last_reason": guard.last_reason,
            "pause_verdicts": dict(guard.verdicts),
            "audits": guard.audits,
            "signals": guard.values(stats["drift"], m.alignment()),
            "bounds": asdict(guard.bounds),
        }
        return stats

    def health(self) -> Health:
        """The counters a server exports (see :class:`~.monitoring.Health`)."""
        health = self.model.health()
        if self.one_forward:
            health = replace(health, adapting=False)
        guard = self.guard
        if guard is None:
            return health
        return replace(health, guard_audits=guard.audits,
                       guard_theta0_verdicts=guard.verdicts["theta0"] + guard.verdicts["hold"])

    # ----------------------------------------------------------------- the state
    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state (arrays and scalars)."""
        self._sync_state()
        return self.state.to_dict()

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Replace the state; shapes are checked before anything changes."""
        state = AdaptState.from_dict(values)
        self._engine().limits.check(state)
        self._install(state)

    def state_bytes(self) -> bytes:
        """The state as checksummed npz bytes (see :mod:`.state`)."""
        self._sync_state()
        return encode_state(self.state, self.fingerprint, self._use())

    def _use(self) -> dict[str, Any]:
        """What decides how this policy uses a state, as a state's ``info`` records it: the
        method, the model's architecture, whether it adapts apart from serving
        (``asynchronous``) and its ``budget`` (forwards per sample; None: every batch)."""
        return {"method": self.method, "model": self.metadata.architecture,
                "asynchronous": self.asynchronous,
                "budget": getattr(self.model.config, "budget", None)}

    def parse_state_bytes(self, data: bytes) -> AdaptState:
        """Decode and validate state bytes for this model (sizes from the archive headers
        first, checksum, fingerprint, every value and shape) without touching the current
        state, so it may run on any thread; StateError names what is wrong."""
        m = self._engine()
        state, info = decode_state(data, m.fingerprint, self.state_sizes(),
                                   self.metadata.architecture)
        self._check_use(info, state)
        m.limits.check(state)
        return state

    def _check_use(self, info: dict, state: AdaptState) -> None:
        """StateMismatch, naming both uses, unless this policy can honour the state written by
        ``info``'s use (:meth:`_use`; a state from a version before a field was written is
        taken on the rest): the same method (a NoAdapt server never serves an adapted theta, a
        ZOA server never steps on from an EVA-0 state), and no adapted theta for the
        one-forward tier (budget 1 serves theta0 with no guard: an adapted theta there would
        be served forever, unwatched). Either mode and any other budget of the same method
        take each other's states: theta, the shift's windows and the bank mean the same in
        both, the budget's fill is a share of whatever bucket reads it."""
        written = info.get("method")  # decode_state hands a dict, empty when the file had none
        if written is not None and written != self.method:
            raise StateMismatch(f"this state was written by {_use_in_words(info)}, not this "
                                f"server's {_use_in_words(self._use())}: load it where "
                                f"--method {written} runs")
        theta0 = self.metadata.theta0
        if self.one_forward and self.spec.keeps_state and not np.array_equal(
                state.theta, np.asarray(theta0, dtype=state.theta.dtype)):
            raise StateMismatch(
                f"this state holds a theta adapted by {_use_in_words(info)}; this server "
                f"({_use_in_words(self._use())}) serves theta0 with no guard and would serve "
                f"the adapted theta unwatched: load it where {self.method} adapts (a budget "
                "above 1)")

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
        m = self._engine()
        state, info = read_state_file(path, m.fingerprint, self.state_sizes(),
                                      self.metadata.architecture)
        self._check_use(info, state)
        m.limits.check(state)
        self._install(state)

    def state_sizes(self) -> dict[str, int]:
        """Elements of every state array for this model."""
        sizes = self._engine().limits.sizes
        assert sizes is not None  # state_limits sets them
        return sizes

    def _install(self, state: AdaptState) -> None:
        self._engine().install(state)
        self._restart()  # the guard's signal windows warm up again
        if self.budget is not None:
            self.budget.fill = state.budget_fill

    def _sync_state(self) -> None:
        """Copy the running counters that live outside the state into it."""
        m = self._engine()
        m.sync_state()
        if self.budget is not None:
            m.state.budget_fill = self.budget.fill
        if self.bank is not None:
            self.bank.write(m.state)

    # ----------------------------------------------------------------- the policy
    def step(self, x: np.ndarray) -> np.ndarray:
        """Serve the batch and (for adapting methods) adapt on it; logits [B, K] (shifted when
        the activation shift is on)."""
        self.learn()
        return self._step(x, adapt=True)

    def serve_step(self, x: np.ndarray) -> np.ndarray:
        """The asynchronous server's answer: :meth:`step` without the method's own step (the
        guard's duels still run, the budget earns the batch's credit); the batch is adapted on
        later, if at all, by a pass (:meth:`begin_pass`).

        A batch of fewer than ``LEARN_BLOCK`` (8) rows served at theta is answered with the
        windows as the last block left them, and what it teaches (the input change detector,
        the activation shift's window, the budget's credit, a change of stream) waits until
        ``LEARN_BLOCK`` rows have come, then is learnt in one go (:meth:`learn`; the windows
        are per sample, so they end where one-at-a-time learning would leave them, a change
        is called at the block's end). One image then pays the detector's and the window's
        NumPy once per block (in place: 116 of its 912 us,
        ``results/serve-async/learn-after/served_path.txt``). Larger batches are served
        and learnt from as :meth:`step` does."""
        m = self._engine()
        if not self._adapting() or (not self._waiting and x.shape[0] >= LEARN_BLOCK):
            self.learn()
            return self._step(x, adapt=False)
        x = m.session.check_input(x)
        served, features = m.answer(x)
        self._waiting.append((x, features))
        if sum(images.shape[0] for images, _ in self._waiting) >= LEARN_BLOCK:
            self.learn()
        return served

    def learn(self) -> None:
        """Learn from the served batches :meth:`serve_step` left waiting, in one go (the
        worker calls it before anything reads or writes the state: a pass, a control
        operation, a snapshot, the stop)."""
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, []
        x = np.concatenate([images for images, _ in waiting])
        features = np.concatenate([rows for _, rows in waiting])
        m = self._engine()
        inputs_changed = self._inputs_changed(x)
        if self.budget is not None:
            self.budget.earn(x.shape[0])
        shift_changed = m.learn_served(features)
        self._after_change(inputs_changed or shift_changed)

    def begin_pass(self, x: np.ndarray) -> AdaptationPass | None:
        """Begin the adaptation pass on x [B, C, H, W] (already answered) when adaptation is on
        (not frozen, no guard pause) and the budget's credit pays for it (spent now); None
        otherwise. Nothing is served; the input and shift change detectors saw x when it was
        served. The pass's :meth:`~AdaptationPass.run` may run on any thread."""
        self.learn()
        m = self._engine()
        if not self._adapting():
            return None
        if self.budget is not None and not self.budget.spend(x.shape[0]):
            return None
        return AdaptationPass(self, m, m.begin_served(x))

    def _finish_pass(self, served: ServedPass, est: GradientEstimate) -> bool:
        """:meth:`AdaptationPass.finish`."""
        self.learn()
        m = self._engine()
        if not m.current(served) or not self._adapting():
            return False
        prediction = m.finish_served(served, est)
        if prediction is not None:
            if self.guard is not None:
                self._watch(self.guard, prediction)
            self._after_change(False)
        return True

    def _pause_left(self) -> int:
        """Samples left in the health guard's pause (a state's; 0 for a method without it)."""
        return self._engine().state.pause_left if self.spec.guard else 0

    def _adapting(self) -> bool:
        """Whether the method's step may run now: it adapts, not frozen, no guard pause."""
        return not self.one_forward and not self.model.frozen and self._pause_left() == 0

    def _step(self, x: np.ndarray, adapt: bool) -> np.ndarray:
        m = self.model
        if self.one_forward:
            if m.shift is None or m.frozen:
                return m.predict(x)
            return m.serve(m.session.check_input(x))[0]
        paused = self._pause_left()
        if m.frozen or (paused > 0 and self.guard is None):
            logits = m.predict(x)
            if paused > 0:
                self._engine().state.pause_left = max(0, paused - logits.shape[0])
            return logits
        x = m.session.check_input(x)
        inputs_changed = self._inputs_changed(x)  # a recall from the bank may end an audit
        if self.guard is not None and self._pause_left() > 0:
            return self._paused_step(self.guard, x, inputs_changed)
        if self.budget is not None:  # serving apart only earns; the step earns and spends
            if adapt:
                adapt = self.budget.adapt(x.shape[0])
            else:
                self.budget.earn(x.shape[0])
        if not adapt:
            served, shift_changed = m.serve(x)
            self._after_change(inputs_changed or shift_changed)
            return served
        served, shift_changed, prediction = m.adapt(x)
        if prediction is None:  # a skipped step: nothing was written, nothing to watch
            return served
        if self.guard is not None:
            self._watch(self.guard, prediction)
        self._after_change(inputs_changed or shift_changed)
        return served

    def _after_change(self, stream_changed: bool) -> None:
        """After a batch: on a new stream (seen in the images or by the shift's change
        detector) the budget spends densely, and an audit asks whether what was learnt is
        still better than theta0 there (frost-adapted ViT on clean images: 63% of the first
        100); the guard's periodic audit otherwise when due."""
        if self._known_change:  # recalled from the bank: a stream already learnt
            self._known_change = stream_changed = False
        if stream_changed and self.budget is not None:
            self.budget.changed()
        guard = self.guard
        if guard is None or self._pause_left():
            return
        m = self._engine()
        now = stream_changed and m.config.guard_change_audit and \
            not np.array_equal(m.state.theta, m.metadata.theta0)
        if not self._affords_duel(guard.warmup):
            if now:  # the audit at a change the credit cannot pay for: theta0 wins it
                self._lose_duel("the audit at a change of stream")
            return  # a periodic audit waits for the credit
        if guard.start_audit(m.config.guard_audit, now):
            m.state.pause_left = guard.warmup

    def _affords_duel(self, samples: int) -> bool:
        """Whether the budget's credit pays a duel of the guard over ``samples`` samples (one
        forward each beyond the served one); always True without a budget."""
        return self.budget is None or self.budget.credit >= samples

    def _lose_duel(self, what: str) -> None:
        """A duel the budget cannot pay for is not run: the candidate gives way to theta0, the
        side every duel falls back to (served with one forward per sample)."""
        log.info("compute budget: %s cannot be paid for (credit %.0f forwards); theta0 serves",
                 what, self.budget.credit if self.budget is not None else 0.0)
        m = self._engine()
        m.roll_back(m.metadata.theta0)

    def _inputs_changed(self, x: np.ndarray) -> bool:
        """Feed the input change detector (with the guard, the budget or the domain bank on) the
        images x [B, C, H, W]; on a change the activation shift's window restarts too (it holds
        the old stream's head inputs: the ViT's, after Gaussian noise, moved clean images by the
        noise's offset for a window's length)."""
        watched = self.guard is not None or self.budget is not None or self.bank is not None
        if not watched:
            return False
        key = None if self.bank is None else self._segment_key()
        resident = self.model.session.resident(x)  # described where the images are
        if not self.inputs.observe(x if resident is None else resident):
            if self.bank is not None:
                self._follow_segment(x.shape[0])
            return False
        if self.model.shift is not None:
            self.model.shift.restart(self._engine().state)
        if key is not None:
            self._change_segment(key, x.shape[0])
        return True

    # ----------------------------------------------------------------- the domain bank
    def _segment_key(self) -> np.ndarray:
        """The current segment's input descriptors [6]: the detector's long window's mean and
        variance of each (before the batch that may end the segment)."""
        return np.concatenate(self.inputs.long_window())

    def _note_rows(self) -> np.ndarray:
        """Keep the last ``CHANGE_ROWS`` images' descriptors; return them."""
        rows = np.concatenate([self._last_rows, self.inputs.last_values])[-CHANGE_ROWS:]
        self._last_rows = rows
        return rows

    def _follow_segment(self, batch: int) -> None:
        """A batch of the current segment: counted; once the detector's recent window is full,
        a segment not recalled at its change is looked up in the bank (once)."""
        self._note_rows()
        self._segment_samples += batch
        full = 1.0 - self.inputs.recent_factor**RECENT_SAMPLES
        if self._recall_due and self.inputs.recent_weight >= full and self._may_recall():
            self._recall_due = False
            self._recall(self.inputs.recent_mean, float(RECENT_SAMPLES), count_miss=True)

    def _change_segment(self, key: np.ndarray, batch: int) -> None:
        """A change of stream: the segment that ends is kept in the bank (when it is at least
        ``MIN_SEGMENT_SAMPLES`` long and the guard neither pauses nor holds: a theta it
        vouches for), in the slot it was recalled from if it was; the new one is looked up
        from its first images."""
        bank, guard, m = self.bank, self.guard, self._engine()
        assert bank is not None
        rows = self._note_rows()
        vouched = guard is None or (not self._pause_left() and not guard.holding)
        if self._segment_samples >= MIN_SEGMENT_SAMPLES and vouched and not m.frozen:
            bank.store(m.segment_memory(key, self._segment_samples), self._segment_slot)
        self._segment_slot, self._segment_samples = None, batch
        self._recall_due = True
        if self._may_recall() and self._recall(rows.mean(axis=0), float(len(rows)),
                                               count_miss=False):
            self._recall_due = False
            self._known_change = True

    def _may_recall(self) -> bool:
        """Whether a recall may replace theta now: not frozen, and no pause of the guard but
        an audit (a trip's pause is the guard's to end)."""
        guard = self.guard
        return not self.model.frozen and (
            not self._pause_left() or (guard is not None and guard.auditing))

    def _recall(self, mean: np.ndarray, samples: float, count_miss: bool) -> bool:
        """Look the descriptors' ``mean`` over ``samples`` images up in the bank; on a hit
        restore that segment's state (no forward), end an audit the change started, and let
        the budget spend as on a stream it knows. Returns whether it hit."""
        bank, m, guard = self.bank, self._engine(), self.guard
        assert bank is not None
        slot = bank.recall(mean, samples, count_miss)
        if slot is None:
            return False
        m.recall(bank.memories[slot])
        self._segment_slot = slot
        if guard is not None:
            if guard.auditing:
                m.state.pause_left = 0
            guard.abandon_audit()
        if self.budget is not None:
            self.budget.settle()
        log.info("domain bank: the stream is segment %d again (%d hits); its state restored",
                 slot, bank.hits)
        return True

    # ----------------------------------------------------------------- the health guard
    def _watch(self, guard: HealthGuard, prediction: np.ndarray) -> None:
        """Feed the health guard; checkpoint when healthy, roll back when it trips."""
        m = self._engine()
        reason, checkpoint = guard.observe(prediction, m.drift(), m.alignment())
        st = m.state
        if checkpoint:
            st.healthy_theta = st.theta.copy()
        if reason is None:
            return
        to_source = guard.tripped(reason)
        if self.budget is not None:
            self.budget.changed()
        if to_source or self._affords_duel(m.config.guard_pause) or \
                np.array_equal(st.healthy_theta, m.metadata.theta0):
            m.roll_back(m.metadata.theta0 if to_source else st.healthy_theta)
        else:
            to_source = True
            self._lose_duel("the pause's duel of the last healthy theta")
        st.guard_trips += 1
        st.pause_left = m.config.guard_pause
        log.warning(
            "health guard tripped at step %d: %s; rolled back to %s, adaptation paused for "
            "%d samples", st.step, reason, "theta0" if to_source else "the last healthy theta",
            st.pause_left,
        )

    def _paused_step(self, guard: HealthGuard, x: np.ndarray, inputs_changed: bool) -> np.ndarray:
        """One batch of the guard's pause on the checked x (``inputs_changed``: the input change
        detector saw a new stream in it): the candidate theta and theta0 in one ORT call (one
        forward per sample when the candidate is theta0), theta0's logits [B, K] served; at
        the end of the pause, the guard's verdict picks where adaptation resumes."""
        m = self._engine()
        st, batch = m.state, x.shape[0]
        theta0 = m.metadata.theta0.astype(np.float32)
        dueled = not np.array_equal(st.theta, theta0)
        sides = np.stack([st.theta, theta0]) if dueled else st.theta[None]
        logits, features = m.session.run(x, np.repeat(sides, batch, axis=0))
        m.session.counter.samples += batch
        if self.budget is not None:  # a paused sample earns its credit like a served one
            self.budget.earn(batch)
            if dueled:
                self.budget.charge(batch)
        rows = slice(0, batch) if guard.serving_candidate or not dueled else slice(batch, None)
        served, shift_changed = m.serve_outputs(logits[rows], features[rows])
        if inputs_changed or shift_changed:
            # the verdict is about the stream that follows: judge it on that stream alone
            guard.restart_windows()
            if dueled and not self._affords_duel(guard.warmup + batch):
                self._lose_duel("a duel lengthened by a change of stream")
            st.pause_left = max(st.pause_left, guard.warmup + batch)
        guard.observe_pause(logits, features, dueled)
        st.pause_left = max(0, st.pause_left - batch)
        if st.pause_left == 0:
            self._end_pause(guard, dueled)
        return served

    def _end_pause(self, guard: HealthGuard, dueled: bool) -> None:
        m = self._engine()
        st, cfg = m.state, m.config
        at_change = guard.auditing and not guard.serving_candidate
        what = "audit" if guard.auditing else "pause"
        margin = guard.duel_margin
        held = guard.holding
        verdict = guard.pause_verdict(dueled, min(guard.warmup, cfg.guard_pause))
        if held and verdict != "hold" and m.shift is not None:
            m.shift.restart(st)  # its windows saw a stream theta0 fails on
        keep = verdict == "checkpoint" or (verdict == "hold" and guard.hold_candidate)
        kept = "the duelled theta"
        if dueled and not keep:
            m.roll_back(m.metadata.theta0)
        elif dueled and verdict == "hold" and what == "audit" and (at_change or (
                m.shift is not None and m.shift.degenerate(st))):
            # an audit duels the current theta, which adapted on the stream: at a change of
            # stream it took its last steps on a stream theta0 fails on, and on one with no
            # spread (black frames, noise) that is no learning to keep, so keep the last
            # checkpoint taken while the signals were in bounds (the ResNet-GN kept a theta
            # 4.3 from theta0 after 3 steps on black frames); on a corruption theta0 fails
            # too (fog) met by a periodic audit, what the current theta learnt is kept
            m.roll_back(st.healthy_theta)
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
