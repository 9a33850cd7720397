"""Seeded perturbations for the SPSA estimators.

Step ``t`` of a run seeded ``s`` draws from ``SeedSequence([s, t])``: child streams of N(0, I)
rows (random exploration), of U(0, 2) rows (anchor-guided rows) and of the anchor-row choice.
Rows are drawn in order from their stream, so a chunk-by-chunk regeneration yields the very same
Z as one draw: with ``regenerate_z`` the [B, P] matrix is never held, only a few rows x P at a
time (MeZO's seed trick).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def anchor_direction(theta: np.ndarray, anchor: np.ndarray, delta: float = 1e-8) -> np.ndarray:
    """d_bar = d sqrt(P) / (||d|| + delta), d = anchor - theta: the anchor direction scaled to
    the expected norm of a N(0, I_P) draw (sqrt(P) is the paper's E||u|| up to O(1/sqrt(P)))."""
    d = anchor - theta
    return d * (np.sqrt(d.size) / (np.linalg.norm(d) + delta))


@dataclass(frozen=True)
class PerturbationPlan:
    """Which rows of one step are anchor-guided, and how to (re)draw the step's Z.

    seed, step: the stream. rows: B (or 1 for a batch-shared perturbation). anchor_rows: sorted
    indices of anchor-guided rows. d_bar: [P] scaled anchor direction (used by anchor rows).
    """

    seed: int
    step: int
    rows: int
    anchor_rows: tuple[int, ...]
    d_bar: np.ndarray

    @classmethod
    def create(
        cls, seed: int, step: int, rows: int, n_anchor: int, d_bar: np.ndarray
    ) -> PerturbationPlan:
        """Pick ``n_anchor`` of ``rows`` uniformly at random (from the step's third stream)."""
        choose = np.random.default_rng(np.random.SeedSequence([seed, step]).spawn(3)[2])
        anchor_rows = choose.choice(rows, size=min(n_anchor, rows), replace=False)
        return cls(seed, step, rows, tuple(sorted(int(i) for i in anchor_rows)), d_bar)

    def chunks(self, chunk_rows: int) -> Iterator[tuple[slice, np.ndarray]]:
        """Yield (row slice, z [len, P] float32) in row order, covering all rows."""
        normal_seq, uniform_seq, _ = np.random.SeedSequence([self.seed, self.step]).spawn(3)
        normal, uniform = np.random.default_rng(normal_seq), np.random.default_rng(uniform_seq)
        is_anchor = np.zeros(self.rows, dtype=bool)
        is_anchor[list(self.anchor_rows)] = True
        size = self.d_bar.size
        for start in range(0, self.rows, chunk_rows):
            stop = min(start + chunk_rows, self.rows)
            mask = is_anchor[start:stop]
            z = np.empty((stop - start, size), dtype=np.float32)
            n_random = int((~mask).sum())
            if n_random:
                z[~mask] = normal.standard_normal((n_random, size), dtype=np.float32)
            if mask.any():
                r = uniform.uniform(0.0, 2.0, (int(mask.sum()), size)).astype(np.float32)
                z[mask] = self.d_bar[None, :] * r
            yield slice(start, stop), z

    def draw(self) -> np.ndarray:
        """The whole Z: [rows, P] float32."""
        return np.concatenate([z for _, z in self.chunks(self.rows)], axis=0)


class AnchorShare:
    """Keeps k anchor-guided rows per 64 samples at any batch size by accumulating the share:
    at B = 64 each step gets k rows; at B = 1 one step in 64/k gets its single row guided."""

    def __init__(self, per_64: float) -> None:
        if per_64 < 0:
            raise ValueError("anchor_per_64 must be >= 0")
        self.per_64 = per_64
        self.credit = 0.0

    def take(self, batch: int) -> int:
        """How many of this batch's rows are anchor-guided; carries the remainder forward."""
        self.credit += batch * self.per_64 / 64.0
        count = min(int(np.floor(self.credit + 1e-9)), batch)
        self.credit -= count
        return count
