"""What a running adapter reports between steps, the same for every runtime method: the last
step's numbers (:class:`StepStats`) and the health counters a server exports (:class:`Health`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .losses import softmax_entropy


@dataclass
class StepStats:
    """What the last step saw: mean prediction entropy (nats), mean logit norm, skipped, and how
    many of its perturbations were anchor-guided. The entropy and the norm are computed from
    the step's logits when first read (a server reads them far less often than it serves)."""

    logits: np.ndarray | None = field(default=None, repr=False)
    skipped: bool = False
    anchor_rows: int = 0

    @classmethod
    def of(cls, logits: np.ndarray) -> StepStats:
        """The statistics of the logits [B, K] a step returned (a copy is kept)."""
        return cls(logits=np.array(logits, dtype=np.float64))

    @cached_property
    def entropy(self) -> float:
        """Mean entropy (nats) of softmax(logits) over the batch; NaN before any step."""
        if self.logits is None:
            return float("nan")
        return float(softmax_entropy(self.logits).mean())

    @cached_property
    def logit_norm(self) -> float:
        """Mean L2 norm of the logits over the batch; NaN before any step."""
        if self.logits is None:
            return float("nan")
        return float(np.linalg.norm(self.logits, axis=1).mean())


@dataclass(frozen=True)
class Health:
    """Counters of an adapter: steps taken, drift ||theta - theta0|| (the prompt's for FOA),
    health-guard trips, clipped coefficients, whether it adapts now (not frozen, not paused
    by the guard), the guard's audits and the duels theta0 won (audits and pauses that handed
    adaptation back to theta0 or held it there)."""

    step: int
    drift: float
    guard_trips: int
    clipped_coefficients: int
    adapting: bool
    guard_audits: int = 0
    guard_theta0_verdicts: int = 0
