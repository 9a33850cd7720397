"""The one-forward path of an EVA-0-family model (NumPy only): the logits and features of a
batch at one theta per sample, what is handed out for them (an owned copy moved by the
activation shift's logit offset, :mod:`.shift`, recorded as the last served batch), and what
the served head inputs teach the shift's window."""

from __future__ import annotations

import numpy as np

from .monitoring import StepStats
from .session import AdaptableSession
from .shift import ActivationShift
from .state import AdaptState


class ServedForward:
    """The forward at theta and the activation shift around it (``shift`` None: off); ``last``:
    the statistics of the last logits handed out."""

    def __init__(self, session: AdaptableSession, shift: ActivationShift | None) -> None:
        self.session = session
        self.shift = shift
        self.last = StepStats()

    def run(self, x: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits [B, K], features [B, F]) of the checked batch x [B, C, H, W] at ``theta``
        [P] for every sample, one forward per sample (counted)."""
        logits, features = self.session.run(x, np.broadcast_to(theta, (x.shape[0], theta.size)))
        self.session.counter.samples += x.shape[0]
        return logits, features

    def hand_out(self, logits: np.ndarray, state: AdaptState) -> np.ndarray:
        """The logits [B, K] to hand out: shifted by what the samples before this batch taught
        the activation shift (``state``'s windows). An owned copy, recorded in ``last``."""
        served = self.session.owned(logits)
        if self.shift is not None:
            served = (served + self.shift.offset(state)).astype(logits.dtype)
        self.last = StepStats.of(served)
        return served

    def learn(self, state: AdaptState, features: np.ndarray) -> bool:
        """The served rows' ``features`` [B, F] (stream order) enter the shift's window in
        ``state``; whether its change detector saw a new stream in them."""
        if self.shift is None:
            return False
        changes = self.shift.changes
        self.shift.observe(state, features)
        return self.shift.changes > changes
