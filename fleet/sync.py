"""A replica's side of the fleet state: :class:`FleetSync` reports the replica's adaptation
state (what moved since the last report, the images behind it, whether the guard is quiet) and
applies the merged state it is answered with, keeping the replica's own steps since the report.

The same class runs in the served fleet (the actor through Ray, the model on the server's
worker thread) and in the simulation and tests (an in-process :class:`FleetState`, the model
called inline): there is one copy of the accounting.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server.worker import AdaptationWorker
from eva0_edge.runtime.state import AdaptState

from .merge import apply_merged, progress
from .state_actor import FleetState

log = logging.getLogger("eva0_edge.fleet")

ActorCall = Callable[..., Any]


def ray_actor(actor: Any) -> ActorCall:
    """``call(method, *args)`` of the fleet-state actor through Ray (blocking)."""
    import ray

    def call(method: str, *args: Any) -> Any:
        return ray.get(getattr(actor, method).remote(*args))

    return call


def local_actor(state: FleetState) -> ActorCall:
    """``call(method, *args)`` of an in-process :class:`FleetState`."""

    def call(method: str, *args: Any) -> Any:
        return getattr(state, method)(*args)

    return call


class InlineWorker:
    """Runs operations on the model at once, on the caller's thread (where one thread owns
    the model and steps it itself: the simulation, tests)."""

    def __init__(self, model: Policy) -> None:
        self.model = model

    def call(self, operation: Callable[[Policy], Any]) -> Future:
        future: Future = Future()
        try:
            future.set_result(operation(self.model))
        except Exception as err:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(err)
        return future


class FleetSync:
    """Reports this replica's state every ``every_s`` seconds and applies merged states (a
    :class:`~eva0_edge.runtime.server.extension.ServerExtension`). ``actor``: calls of the
    fleet state (:func:`ray_actor` in the fleet, :func:`local_actor` in one process)."""

    name = "fleet"

    def __init__(self, actor: ActorCall, replica: str, model: Policy,
                 every_s: float) -> None:
        self.actor = actor
        self.replica = replica
        self.every_s = every_s
        self.worker: AdaptationWorker | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the accounting: sync thread against admin operations
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name="eva0-fleet-sync", daemon=True)
        self.version = 0
        self.syncs = self.applied = self.failures = 0
        self.last_sync = 0.0
        self.fleet: dict[str, Any] = {}
        self.theta_digest: str | None = None  # of the fleet theta applied last
        self._join(model)

    def _join(self, model: Policy) -> None:
        """Start from the newest fleet state (a new or restarted replica)."""
        self.version, merged = self.actor("join", self.replica)
        own = AdaptState.from_dict(model.state_dict())
        if merged is not None:
            model.load_state_dict(apply_merged(AdaptState.from_dict(merged), own, own).to_dict())
            log.info("replica %s joined at fleet version %d", self.replica, self.version)
        self._account(model)

    def start(self, worker: AdaptationWorker | InlineWorker) -> None:
        """Start reporting (never with ``every_s`` <= 0: the replica adapts alone)."""
        self.worker = worker
        if self.every_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync_once()
            except Exception as err:  # noqa: BLE001 - the actor may be restarting
                self.failures += 1
                log.warning("fleet sync of %s failed (will retry): %s", self.replica, err)

    def state_replaced(self, model: Policy) -> None:
        """An admin replaced the state (reset, PUT state; worker thread): account from it, so
        the jump is not reported as progress, and drop a sync in flight."""
        with self._lock:
            self._generation += 1
            self._account(model)

    def _account(self, model: Policy) -> None:
        self._accounted = AdaptState.from_dict(model.state_dict())
        self._samples = model.session.counter.samples
        self._trips = model.health().guard_trips

    def sync_once(self) -> None:
        """Report the state (read on the worker thread) and apply the answer, if any."""
        assert self.worker is not None

        def read(m: Policy) -> tuple:
            with self._lock:
                state = AdaptState.from_dict(m.state_dict())
                health = m.health()
                return (self._generation, state, progress(state, self._accounted),
                        m.session.counter.samples - self._samples, m.session.counter.samples,
                        health.adapting and health.guard_trips == self._trips,
                        health.guard_trips)

        generation, state, moved, new_samples, samples, healthy, trips = (
            self.worker.call(read).result()
        )
        version, merged, self.fleet = self.actor(
            "report", self.replica, state.to_dict(), moved, new_samples, healthy,
        )
        self.syncs += 1
        self.last_sync = time.monotonic()
        with self._lock:
            if generation != self._generation:
                return  # an admin replaced the state meanwhile: account from it
            self._accounted, self._samples, self._trips = state, samples, trips
        if merged is None:
            return
        fleet_state = AdaptState.from_dict(merged)

        def install(m: Policy) -> bool:
            with self._lock:
                if generation != self._generation:
                    return False
                m.load_state_dict(
                    apply_merged(fleet_state, state, AdaptState.from_dict(m.state_dict()))
                    .to_dict()
                )
                self._accounted = fleet_state
                return True

        if self.worker.call(install).result():
            self.theta_digest = hashlib.sha256(fleet_state.theta.tobytes()).hexdigest()[:16]
            self.version = version
            self.applied += 1

    def statistics(self) -> dict[str, Any]:
        return {
            **self.fleet,
            "replica": self.replica,
            "pid": os.getpid(),
            "applied_version": self.version,
            "applied_theta_digest": self.theta_digest,
            "applied": self.applied,
            "syncs": self.syncs,
            "sync_failures": self.failures,
            "last_sync_age_s": time.monotonic() - self.last_sync if self.syncs else None,
        }

    def gauges(self) -> list[tuple[str, str, float]]:
        fleet = self.fleet
        return [
            ("eva0_fleet_replicas", "Live replicas in the fleet (at the last sync)",
             float(fleet.get("replicas", 0))),
            ("eva0_fleet_merges", "Merges of the fleet state (at the last sync)",
             float(fleet.get("merges", 0))),
            ("eva0_fleet_version", "Newest fleet-state version (at the last sync)",
             float(fleet.get("version", 0))),
            ("eva0_fleet_applied_version", "Fleet-state version this replica applied last",
             float(self.version)),
            ("eva0_fleet_syncs", "Reports of this replica to the fleet state", float(self.syncs)),
            ("eva0_fleet_sync_failures", "Failed reports of this replica", float(self.failures)),
        ]
