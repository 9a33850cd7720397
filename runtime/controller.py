"""What happens to a batch: the policy around the EVA-0-family engine (NumPy only).

:meth:`StepController.step` decides, per batch x [B, C, H, W], in this order (for the EVA-0
family and, without a guard, FOA: :class:`~.foa.FOAModel` has the same ``serve`` / ``adapt`` /
``predict``):

1. **a method that does not adapt** (NoAdapt, noadapt-shift): one forward at theta, served
   (the activation shift learns from it unless frozen);
2. **the health guard's pause or audit**: the candidate theta and theta0 duel in one ORT call
   (one forward per sample when the candidate is theta0), theta0 or the candidate served; at
   its end the guard's verdict (checkpoint / theta0 / hold) says where adaptation resumes;
3. **frozen** (or paused without a guard): one forward at theta, served;
4. **the compute budget says wait** (:mod:`.budget`): one forward at theta, served, the
   activation shift learning from it;
5. **adapt**: the method's step (:meth:`~.engine.AdaptiveModel.adapt`: estimate, then update),
   then the guard watches the prediction (checkpoint when healthy, roll back and pause when it
   trips).

The asynchronous server splits this in two: :meth:`StepController.serve_step` answers (steps
1-4, the budget earning the batch's credit), and an adaptation pass runs step 5 on batches
already answered, when the worker is idle and the credit pays for it: :meth:`begin_pass` (the
checks, the budget, the perturbed rows), the ORT call (which may run on another thread while
serving goes on), :meth:`finish_pass` (the estimate, the update and the guard, dropped when a
roll-back, reset, installed state, pause or freeze came in between).

After steps 4 and 5, a change of stream (the input change detector, the activation shift's
change detector) makes the budget spend densely and starts the guard's audit at a change; the
guard's periodic audit starts when due. A duel runs only when the budget's credit pays for it;
one it cannot pay for is not run and theta0 serves (:meth:`StepController._lose_duel`).

The engine (:class:`~.engine.AdaptiveModel`) holds the state and does estimate -> update;
this module owns the guard, the budget and the input change detector.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from .budget import ComputeBudget
from .guard import GuardBounds, HealthGuard
from .inputwatch import InputChangeDetector

if TYPE_CHECKING:
    from .engine import AdaptiveModel, ServedPass
    from .foa import FOAModel

log = logging.getLogger(__name__)


class StepController:
    """The guard, the budget and the input change detector of one :class:`AdaptiveModel` (or
    :class:`~.foa.FOAModel`: no guard), and the order in which they act on a batch (see the
    module's docstring). ``guard`` and ``budget`` are None when off. A new controller starts
    their windows afresh (reset, a state installed)."""

    def __init__(self, model: AdaptiveModel | FOAModel) -> None:
        self.model = model
        self.guard = self._new_guard()
        self.budget = self._new_budget()
        self.inputs = InputChangeDetector()
        # a batch answered and not yet learnt from: its checked images and served features
        self._learning: tuple[np.ndarray, np.ndarray] | None = None

    def _engine(self) -> AdaptiveModel:
        """The model as the EVA-0-family engine: what the health guard, its duels and the
        asynchronous server act on. FOA has none of them (its bounds would have to be
        calibrated on prompts), so these paths never reach it."""
        from .engine import AdaptiveModel

        if not isinstance(self.model, AdaptiveModel):
            raise TypeError(f"{self.model.method}: the health guard and asynchronous "
                            "adaptation need an EVA-0-family method")
        return self.model

    def _new_guard(self) -> HealthGuard | None:
        if self.model.spec.kind == "foa" or not self.model.spec.adapts:
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

    def _new_budget(self) -> ComputeBudget | None:
        """The compute budget, or None when the method adapts on every batch."""
        m = self.model
        cfg = m.config
        # adapting apart from serving, an adapted sample costs #FP + 1 forwards: F = #FP
        # still leaves some samples unadapted
        unbounded = cfg.forwards + 1 if m.asynchronous else cfg.forwards
        if not m.spec.adapts or cfg.budget is None or cfg.budget >= unbounded:
            return None
        return ComputeBudget(cfg.budget, cfg.forwards, m.asynchronous, cfg.budget_burst)

    # ----------------------------------------------------------------- the policy
    def step(self, x: np.ndarray) -> np.ndarray:
        """Serve the batch and (for adapting methods) adapt on it; logits [B, K] (shifted when
        the activation shift is on)."""
        return self._step(x, adapt=True)

    def serve_step(self, x: np.ndarray) -> np.ndarray:
        """The asynchronous server's answer: :meth:`step` without the method's own step (the
        guard's duels still run, the budget earns the batch's credit); the batch is adapted on
        later, if at all, by a pass (:meth:`begin_pass`, :meth:`finish_pass`).
        :meth:`answer`, then :meth:`learn`."""
        served = self.answer(x)
        self.learn()
        return served

    def answer(self, x: np.ndarray) -> np.ndarray:
        """:meth:`serve_step` up to the answer, logits [B, K]: when the batch is served at
        theta (no duel, not frozen), what it teaches (the input change detector, the
        activation shift's window, the budget's credit, the signals of a change) waits for
        :meth:`learn`, which the worker runs once the answers are out, before the next batch.
        So every signal a served batch gives acts from the next batch on, as the activation
        shift's own always did: a change the input detector sees in a batch restarts the
        shift's window after that batch is served with the shift it had."""
        self.learn()
        m = self._engine()
        st = m.state
        if not m.spec.adapts or st.frozen or st.pause_left > 0:
            return self._step(x, adapt=False)
        x = m.session.check_input(x)
        served, features = m.answer(x)
        self._learning = (x, features)
        return served

    def learn(self) -> None:
        """What the batch last :meth:`answer`ed teaches, if it has not been learnt yet: the
        input change detector sees it (a change restarts the shift's window), its head inputs
        enter the shift's window, the budget earns its credit, a change of stream is acted on
        (see :meth:`_after_change`)."""
        if self._learning is None:
            return
        (x, features), self._learning = self._learning, None
        m = self._engine()
        inputs_changed = self._inputs_changed(x)
        if self.budget is not None:
            self.budget.earn(x.shape[0])
        shift_changed = m.learn_served(features)
        self._after_change(inputs_changed or shift_changed)

    def begin_pass(self, x: np.ndarray) -> ServedPass | None:
        """Begin the adaptation pass on x [B, C, H, W] (already answered) when adaptation is on
        (not frozen, no guard pause) and the budget's credit pays for it (spent now); None
        otherwise. Nothing is served; the input and shift change detectors saw x when it was
        served. Its ORT call (``model.run_served``) may run on any thread."""
        m = self._engine()
        if not self._adapting(m):
            return None
        if self.budget is not None and not self.budget.spend(x.shape[0]):
            return None
        return m.begin_served(x)

    def finish_pass(self, served: ServedPass, outputs: tuple[np.ndarray, np.ndarray]) -> bool:
        """The pass's estimate from its ORT call's ``outputs`` (logits, features) and its
        update, then the guard watches the step's prediction.
        A pass the state moved away from since it began (``model.current``: a roll-back, a
        reset, a state installed) or begun before a pause or a freeze is dropped: its forwards
        were spent, nothing is written. Returns whether the step ran."""
        m = self._engine()
        if not m.current(served) or not self._adapting(m):
            return False
        prediction = m.finish_served(served, outputs)
        if prediction is not None:
            if self.guard is not None:
                self._watch(self.guard, prediction)
            self._after_change(False)
        return True

    @staticmethod
    def _adapting(m: AdaptiveModel) -> bool:
        """Whether the method's step may run now: it adapts, not frozen, no guard pause."""
        return m.spec.adapts and not m.state.frozen and m.state.pause_left == 0

    def _step(self, x: np.ndarray, adapt: bool) -> np.ndarray:
        m = self.model
        st = m.state
        if not m.spec.adapts:
            if m.shift is None or st.frozen:
                return m.predict(x)
            return m.serve(m.session.check_input(x))[0]
        if st.pause_left > 0 and not st.frozen and self.guard is not None:
            return self._paused_step(self.guard, x)
        if st.frozen or st.pause_left > 0:
            logits = m.predict(x)
            st.pause_left = max(0, st.pause_left - logits.shape[0])
            return logits
        x = m.session.check_input(x)
        inputs_changed = self._inputs_changed(x)
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
        if stream_changed and self.budget is not None:
            self.budget.changed()
        guard = self.guard
        if guard is None or self.model.state.pause_left:
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
        """Feed the input change detector (with the guard or the budget on) the images x
        [B, C, H, W]; on a change the activation shift's window restarts too (it holds the old
        stream's head inputs: the ViT's, after Gaussian noise, moved clean images by the
        noise's offset for a window's length)."""
        if (self.guard is None and self.budget is None) or not self.inputs.observe(x):
            return False
        if self.model.shift is not None:
            self.model.shift.restart(self.model.state)
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

    def _paused_step(self, guard: HealthGuard, x: np.ndarray) -> np.ndarray:
        """One batch of the guard's pause: the candidate theta and theta0 in one ORT call (one
        forward per sample when the candidate is theta0), theta0's logits [B, K] served; at
        the end of the pause, the guard's verdict picks where adaptation resumes."""
        m = self._engine()
        x = m.session.check_input(x)
        inputs_changed = self._inputs_changed(x)
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
