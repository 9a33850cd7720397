"""Merging the adaptation states of a fleet's replicas (pure NumPy; Ray only carries them).

Every replica adapts on its own stream and, every few seconds, reports its state and its
*progress*: the change of every merged quantity since the point it last accounted for (its
previous report, or the fleet state it last applied). A merge of the fleet state G:

1. keeps the reports that agree: replicas whose windowed feature means lie within
   ``threshold`` of each other (RMS over features of the mean difference over the pooled
   standard deviation, :func:`feature_distance`) form groups; the group with the most samples
   is the fleet's domain; the others (another domain) keep adapting on their own;
2. leaves out unhealthy reports (the health guard tripped or held, or the replica is frozen);
3. moves G by the kept progress. theta and the velocity move by steps: ``"mean"`` (the
   default) by their sample-weighted average (weights: images adapted on since the last
   accounted point, at least one), so the fleet adapts per image at 1/N of one process's rate;
   ``"sum"`` adds them (distinct images of one stream, so to first order the fleet moves per
   image as one process would; measured worse: the replicas' steps from the same stale point
   overshoot together, see the README). Snapshots and windowed statistics (the
   anchor, the guard's healthy checkpoint, the output centre and feature moments and their
   weights and scales) always move by the sample-weighted average: their sum would overshoot
   (N replicas that each moved a checkpoint by d would move it by N d).

The activation-shift windows are never merged: each replica keeps its own (its recent inputs and
its restarts on a change of stream). Merged, a replica that had just restarted on a new domain
got the other replicas' windows of the old one back (``studies/fleet-sim/``, ResNet-GN,
continual stream, 4 replicas merged every 25 images, two seeds: 0.6 points below keeping them).

A replica that applies G keeps its progress since its report (:func:`apply_merged`) and
accounts from G on, so no progress is lost or counted twice. With no step between a report and
the answer, every replica that applies G holds G's quantities exactly.

Per-replica counters (steps, skips, clips, guard trips, pauses, the seed, frozen) are never
merged: a replica keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eva0_edge.runtime.state import AdaptState

MERGED_ARRAYS = ("theta", "anchor", "velocity", "healthy_theta", "center", "mean", "second_moment")
MERGED_SCALARS = ("stat_weight", "coef_scale", "coef_weight")
STEPPED = ("theta", "velocity")  # moved by steps; the rest are snapshots and windowed statistics
Progress = dict[str, np.ndarray | float]


@dataclass
class Report:
    """One replica's report: its state now (for the agreement test), its
    progress since its last accounted point (:func:`progress`), the images adapted on meanwhile,
    and whether it stayed healthy (no guard trip or hold, not frozen)."""

    replica: str
    state: AdaptState
    progress: Progress
    samples: int
    healthy: bool = True


def progress(now: AdaptState, since: AdaptState) -> Progress:
    """``now - since`` for every merged array and scalar."""
    out: Progress = {
        n: getattr(now, n).astype(np.float64) - getattr(since, n) for n in MERGED_ARRAYS
    }
    out.update({n: float(getattr(now, n) - getattr(since, n)) for n in MERGED_SCALARS})
    return out


def add_progress(a: Progress, b: Progress) -> Progress:
    """Two consecutive progresses as one."""
    return {k: a[k] + b[k] for k in a}


def feature_distance(a: AdaptState, b: AdaptState) -> float:
    """RMS over features of (mean_a - mean_b) / pooled std (0 when either has no statistics)."""
    if a.stat_weight <= 0 or b.stat_weight <= 0:
        return 0.0
    var = 0.5 * (
        np.maximum(a.second_moment - a.mean**2, 0.0) + np.maximum(b.second_moment - b.mean**2, 0.0)
    )
    z = (a.mean - b.mean) / np.sqrt(var + 1e-12)
    return float(np.sqrt(np.mean(z**2)))


def agreeing(reports: list[Report], threshold: float) -> list[int]:
    """Indices of the largest group (by samples) of reports within ``threshold`` of one of
    them (see the module docstring)."""
    if not reports:
        return []
    weights = [max(r.samples, 1) for r in reports]
    groups = [
        [j for j, other in enumerate(reports)
         if feature_distance(report.state, other.state) <= threshold]
        for report in reports
    ]
    return max(groups, key=lambda g: (sum(weights[j] for j in g), -g[0]))


def _bounded(state: AdaptState) -> AdaptState:
    """Weights back into [0, 1], scales >= 0 and second moments >= the squared means after
    adding progress (a feature that is always 0 has a moment of 0, which float sums of
    differences leave at -1e-17)."""
    state.second_moment = np.maximum(state.second_moment, state.mean**2)
    state.stat_weight = min(max(state.stat_weight, 0.0), 1.0)
    state.coef_weight = min(max(state.coef_weight, 0.0), 1.0)
    state.coef_scale = max(state.coef_scale, 0.0)
    return state


COMBINE = ("sum", "mean")


def merge(
    current: AdaptState, reports: list[Report], threshold: float, combine: str = "mean"
) -> tuple[AdaptState | None, list[str], list[str]]:
    """The new fleet state (None when no kept report adapted on any image since the last
    merge), the replicas it averaged, and those left out (disagreeing or unhealthy)."""
    group = set(agreeing(reports, threshold))
    kept = [r for i, r in enumerate(reports) if i in group and r.healthy]
    left_out = [r.replica for r in reports if all(r is not k for k in kept)]
    if not any(r.samples for r in kept):  # nothing new: the fleet state stays as it is
        return None, [], left_out
    if combine not in COMBINE:
        raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")
    weights = np.array([max(r.samples, 1) for r in kept], dtype=np.float64)
    weights /= weights.sum()
    scales = np.ones(len(kept)) if combine == "sum" else weights
    merged = current.copy()
    for name in MERGED_ARRAYS:
        share = scales if name in STEPPED else weights
        step = share @ np.stack([r.progress[name] for r in kept])
        with np.errstate(over="ignore"):  # a sum past float32's range: the actor refuses it
            value = (getattr(current, name) + step).astype(getattr(current, name).dtype)
        setattr(merged, name, value)
    for name in MERGED_SCALARS:
        step = float(weights @ np.array([r.progress[name] for r in kept]))
        setattr(merged, name, float(getattr(current, name) + step))
    merged.step = max(r.state.step for r in kept)
    return _bounded(merged), [r.replica for r in kept], left_out


def apply_merged(merged: AdaptState, reported: AdaptState, current: AdaptState) -> AdaptState:
    """What a replica installs on receiving ``merged``: the merged quantities plus its own
    progress since it reported ``reported`` (``current - reported``), its own counters kept."""
    out = current.copy()
    for name in MERGED_ARRAYS:
        delta = getattr(current, name) - getattr(reported, name)
        setattr(out, name, (getattr(merged, name) + delta).astype(getattr(current, name).dtype))
    for name in MERGED_SCALARS:
        delta = getattr(current, name) - getattr(reported, name)
        setattr(out, name, float(getattr(merged, name) + delta))
    return _bounded(out)
