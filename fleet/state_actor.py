"""The fleet state: the one place the replicas' adaptation states meet (a Ray actor).

Replicas ``join`` (and get the newest fleet state to start from) and ``report`` their state and
progress every few seconds (two reports before a merge add up). Once every live replica (one
heard from within ``live_s`` seconds) has reported since the last merge, the reports are merged
(:mod:`.merge`), the fleet version goes up, and the merged state is written atomically to the
state directory by this actor alone (the snapshot format of ``eva0-edge serve --state-dir``, so
a plain server can resume from it). Each
report's answer carries the newest merged state its replica has not applied yet, unless that
replica was left out for disagreeing (another domain: it keeps adapting on its own).

The class is plain Python; :func:`.serve.start_fleet` runs it as a named Ray actor that Ray
restarts if its process dies (it resumes from the newest snapshot).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eva0_edge.runtime.server.snapshots import SnapshotStore
from eva0_edge.runtime.state import (
    AdaptState,
    StateError,
    check_state_sizes,
    decode_state,
    encode_state,
)

from .merge import Progress, Report, add_progress, merge

log = logging.getLogger("eva0_edge.fleet")


@dataclass
class FleetConfig:
    """threshold: feature distance beyond which a replica is another domain (see
    :func:`.merge.feature_distance`); combine: how progress combines, "sum" or "mean" (see
    :mod:`.merge`); live_s: seconds after which a silent replica no longer
    holds a merge back; state_dir / keep: fleet snapshots (None: memory only)."""

    threshold: float = 1.0
    combine: str = "mean"
    live_s: float = 10.0
    state_dir: str | None = None
    keep: int = 3


@dataclass
class _Replica:
    seen: float
    report: Report | None = None
    applied: int = 0  # fleet version it runs on
    left_out: bool = False


@dataclass
class FleetCounters:
    """What the fleet exports: merges, reports, replicas left out of the last merge."""

    merges: int = 0
    reports: int = 0
    left_out_disagree: int = 0
    left_out_unhealthy: int = 0
    snapshots_written: int = 0
    snapshot_failures: int = 0
    merges_refused: int = 0
    last_merge_time: float = 0.0
    last_merged: list[str] = field(default_factory=list)
    last_left_out: list[str] = field(default_factory=list)


class FleetState:
    """Merges reports into versions of the fleet state (see the module docstring)."""

    def __init__(self, initial: dict[str, Any], fingerprint: str, sizes: dict[str, int],
                 method: str, config: FleetConfig | None = None) -> None:
        self.config = config or FleetConfig()
        self.fingerprint = fingerprint
        self.sizes = dict(sizes)
        self.method = method
        self.version = 0
        self.state = AdaptState.from_dict(initial)
        self.snapshots = (
            SnapshotStore(self.config.state_dir, self.config.keep)
            if self.config.state_dir else None
        )
        if self.snapshots is not None:
            self._resume(sizes)
        self.replicas: dict[str, _Replica] = {}
        self.counters = FleetCounters()

    def _resume(self, sizes: dict[str, int]) -> None:
        assert self.snapshots is not None
        loaded = self.snapshots.load_newest(
            lambda path: decode_state(path.read_bytes(), self.fingerprint, sizes)
        )
        if loaded is not None:
            path, (self.state, info) = loaded
            self.version = int(info.get("fleet_version", 0))
            log.info("fleet resumed from %s (version %d)", path, self.version)

    def join(self, replica: str) -> tuple[int, dict[str, Any] | None]:
        """Register ``replica``; the fleet version and state to start from (None at version 0:
        the source state, which a fresh replica already has)."""
        self.replicas[replica] = _Replica(seen=time.monotonic(), applied=self.version)
        return self.version, self.state.to_dict() if self.version else None

    def report(self, replica: str, state: dict[str, Any], progress: Progress, samples: int,
               healthy: bool) -> tuple[int, dict[str, Any] | None, dict[str, Any]]:
        """Take a replica's state and progress; merge when every live replica has reported.
        Returns the newest version, its state when the replica should apply it (else None),
        and the fleet's statistics."""
        reported = self._checked(state, progress)
        now = time.monotonic()
        entry = self.replicas.setdefault(replica, _Replica(seen=now))
        entry.seen = now
        pending = entry.report
        entry.report = Report(
            replica, reported,
            progress if pending is None else add_progress(pending.progress, progress),
            samples + (pending.samples if pending else 0),
            healthy and (pending.healthy if pending else True),
        )
        self.counters.reports += 1
        live = {k: v for k, v in self.replicas.items() if now - v.seen <= self.config.live_s}
        for gone in set(self.replicas) - set(live):
            log.info("replica %s silent for over %.0f s: no longer waited for", gone,
                     self.config.live_s)
            del self.replicas[gone]
        if all(v.report is not None for v in live.values()):
            self._merge(list(live.values()))
        if entry.left_out or entry.applied >= self.version:
            return self.version, None, self.statistics()
        entry.applied = self.version
        return self.version, self.state.to_dict(), self.statistics()

    def _checked(self, state: dict[str, Any], progress: Progress) -> AdaptState:
        """The report's state, after checking it and its progress against the model's sizes
        (StateError names the first problem; nothing changes)."""
        parsed = AdaptState.from_dict(state)
        check_state_sizes(parsed, self.sizes)
        for name, value in progress.items():
            expected = getattr(parsed, name)
            if np.shape(value) != np.shape(expected) or not np.all(np.isfinite(value)):
                raise StateError(f"report: progress of {name} is malformed or not finite")
        return parsed

    def _merge(self, entries: list[_Replica]) -> None:
        reports = [e.report for e in entries if e.report is not None]
        merged, kept, left_out = merge(
            self.state, reports, self.config.threshold, self.config.combine
        )
        unhealthy = {r.replica for r in reports if not r.healthy}
        for entry in entries:
            assert entry.report is not None
            name = entry.report.replica
            entry.left_out = name in left_out and name not in unhealthy
            entry.report = None
        self.counters.left_out_unhealthy += len(unhealthy)
        self.counters.left_out_disagree += len(set(left_out) - unhealthy)
        self.counters.last_left_out = left_out
        if merged is None:
            return
        try:  # finite reports can still sum past float32's range (--fleet-combine sum)
            AdaptState.from_dict(merged.to_dict())
        except StateError as err:
            self.counters.merges_refused += 1
            log.error("merge refused, the fleet state stays at version %d: %s", self.version, err)
            return
        self.version += 1
        self.state = merged
        self.counters.merges += 1
        self.counters.last_merge_time = time.time()
        self.counters.last_merged = kept
        self._snapshot()

    def _snapshot(self) -> None:
        if self.snapshots is None:
            return
        data = encode_state(self.state, self.fingerprint,
                            {"method": self.method, "fleet_version": self.version})
        try:
            self.snapshots.save_bytes(data)
            self.counters.snapshots_written += 1
        except OSError as err:
            self.counters.snapshot_failures += 1
            log.error("fleet snapshot failed, will retry at the next merge: %s", err)

    def flush(self) -> int:
        """Write a snapshot of the fleet state now (at shutdown); the snapshots written so far."""
        self._snapshot()
        return self.counters.snapshots_written

    def statistics(self) -> dict[str, Any]:
        """The fleet's counters (JSON-serialisable)."""
        c = self.counters
        return {
            "replicas": len(self.replicas),
            "version": self.version,
            "merges": c.merges,
            "reports": c.reports,
            "left_out_disagree": c.left_out_disagree,
            "left_out_unhealthy": c.left_out_unhealthy,
            "snapshots_written": c.snapshots_written,
            "snapshot_failures": c.snapshot_failures,
            "merges_refused": c.merges_refused,
            "last_merge_age_s": time.time() - c.last_merge_time if c.merges else None,
            "last_merged": c.last_merged,
            "last_left_out": c.last_left_out,
        }
