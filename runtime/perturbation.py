"""Seeded perturbations for the SPSA estimators.

Step ``t`` of a run seeded ``s`` draws from ``SeedSequence([s, t])``: child streams of N(0, I)
rows (random exploration), of U(0, 2) rows (anchor-guided rows) and of the anchor-row choice.
Rows are drawn in order from their stream, so a chunk-by-chunk regeneration yields the very same
Z as one draw: with ``regenerate_z`` the [B, P] matrix is never held, only a few rows x P at a
time (MeZO's seed trick).

:class:`NormalPrefetch` draws the next step's N(0, I) rows on a background thread while ONNX
Runtime runs the current step (both release the GIL): the rows are those of the step's own
stream, so a prefetched step equals an unprefetched one bit for bit (on CUDA the host's draw
was a third of the step, overlapped with nothing).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np


def step_streams(seed: int, step: int) -> list[np.random.SeedSequence]:
    """The step's three streams: N(0, I) rows, U(0, 2) anchor factors, the anchor-row choice."""
    return np.random.SeedSequence([seed, step]).spawn(3)


@dataclass(frozen=True)
class DrawnNormals:
    """The first rows of step (``seed``, ``step``)'s N(0, I) stream, drawn ahead: ``rows``
    [k, P] float32, and ``state_after``, the stream's bit-generator state after them."""

    seed: int
    step: int
    rows: np.ndarray
    state_after: Mapping[str, Any]

    @classmethod
    def draw(cls, seed: int, step: int, count: int, size: int) -> DrawnNormals:
        """Draw ``count`` rows of ``size`` from the start of the step's normal stream."""
        normal = np.random.default_rng(step_streams(seed, step)[0])
        rows = normal.standard_normal((count, size), dtype=np.float32)
        return cls(seed, step, rows, normal.bit_generator.state)


class NormalRows:
    """Rows of a step's N(0, I) stream in order: the drawn-ahead rows first (if any), then
    the stream itself from where they stop."""

    def __init__(self, seed: int, step: int, ahead: DrawnNormals | None) -> None:
        if ahead is not None and (ahead.seed, ahead.step) != (seed, step):
            raise ValueError(f"rows drawn for step {ahead.step} (seed {ahead.seed}) given to "
                             f"step {step} (seed {seed})")
        self.ahead = ahead
        self.used = 0
        self.generator = np.random.default_rng(step_streams(seed, step)[0])
        if ahead is not None:
            self.generator.bit_generator.state = ahead.state_after

    def take(self, count: int, size: int) -> np.ndarray:
        """The next ``count`` rows [count, size] float32."""
        parts = []
        if self.ahead is not None and self.used < len(self.ahead.rows):
            if self.ahead.rows.shape[1] != size:
                raise ValueError(f"rows drawn ahead have {self.ahead.rows.shape[1]} columns, "
                                 f"not {size}")
            parts.append(self.ahead.rows[self.used : self.used + count])
        rest = count - sum(len(part) for part in parts)
        if rest or not parts:
            parts.append(self.generator.standard_normal((rest, size), dtype=np.float32))
        self.used += count
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class NormalPrefetch:
    """Draws one step's normal rows ahead on a worker thread: :meth:`start` for the step to
    come, :meth:`take` when it comes (None when what was drawn is for another step or size,
    e.g. after a paused or skipped step: that step then draws its own). ``hits``: the steps
    served from rows drawn ahead."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eva0-normals")
        self._pending: tuple[tuple[int, int, int], Future[DrawnNormals]] | None = None
        self.hits = 0

    def start(self, seed: int, step: int, count: int, size: int) -> None:
        """Begin drawing ``count`` rows of ``size`` for step (``seed``, ``step``)."""
        self._pending = ((seed, step, size),
                         self._pool.submit(DrawnNormals.draw, seed, step, count, size))

    def take(self, seed: int, step: int, size: int) -> DrawnNormals | None:
        """The rows drawn ahead for this step (waiting for the draw to end), or None."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != (seed, step, size):
            return None
        self.hits += 1
        return pending[1].result()


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
    ahead: the step's first normal rows, drawn ahead (:class:`NormalPrefetch`), or None.
    """

    seed: int
    step: int
    rows: int
    anchor_rows: tuple[int, ...]
    d_bar: np.ndarray
    ahead: DrawnNormals | None = None

    @classmethod
    def create(
        cls, seed: int, step: int, rows: int, n_anchor: int, d_bar: np.ndarray,
        ahead: DrawnNormals | None = None,
    ) -> PerturbationPlan:
        """Pick ``n_anchor`` of ``rows`` uniformly at random (from the step's third stream)."""
        choose = np.random.default_rng(step_streams(seed, step)[2])
        anchor_rows = choose.choice(rows, size=min(n_anchor, rows), replace=False)
        return cls(seed, step, rows, tuple(sorted(int(i) for i in anchor_rows)), d_bar, ahead)

    @property
    def normal_rows(self) -> int:
        """How many rows are N(0, I) draws (the rest are anchor-guided)."""
        return self.rows - len(self.anchor_rows)

    def chunks(self, chunk_rows: int) -> Iterator[tuple[slice, np.ndarray]]:
        """Yield (row slice, z [len, P] float32) in row order, covering all rows."""
        normal = NormalRows(self.seed, self.step, self.ahead)
        uniform = np.random.default_rng(step_streams(self.seed, self.step)[1])
        is_anchor = np.zeros(self.rows, dtype=bool)
        is_anchor[list(self.anchor_rows)] = True
        size = self.d_bar.size
        for start in range(0, self.rows, chunk_rows):
            stop = min(start + chunk_rows, self.rows)
            mask = is_anchor[start:stop]
            z = np.empty((stop - start, size), dtype=np.float32)
            n_random = int((~mask).sum())
            if n_random:
                z[~mask] = normal.take(n_random, size)
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
        self.credit = max(self.credit - count, 0.0)  # the 1e-9 may round it a hair below 0
        return count
