"""What a running adapter reports between steps, the same for every runtime method: the last
step's numbers (:class:`StepStats`) and the health counters a server exports (:class:`Health`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .losses import softmax_entropy


@dataclass
class StepStats:
    """What the last step saw: mean prediction entropy (nats), mean logit norm, skipped, and how
    many of its perturbations were anchor-guided."""

    entropy: float = float("nan")
    logit_norm: float = float("nan")
    skipped: bool = False
    anchor_rows: int = 0

    @classmethod
    def of(cls, logits: np.ndarray) -> StepStats:
        """The statistics of the logits [B, K] a step returned."""
        p = logits.astype(np.float64)
        return cls(
            entropy=float(softmax_entropy(p).mean()),
            logit_norm=float(np.linalg.norm(p, axis=1).mean()),
        )


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
