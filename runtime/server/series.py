"""The server's adaptation over time: a bounded ring of points, one per interval (default one
per second over the last hour), for the dashboard (``GET /dashboard``), its JSON route
(``GET /v2/models/{name}/adaptation/series``) and ``eva0-edge top``.

A point covers the time since the previous one (at least ``interval_s``, longer while the server
idles) and holds, as of its end:

* what was served in it: ``requests`` answered (status 200), ``images`` (their rows),
  ``images_per_s``, and the requests' latency ``latency_p50_ms`` / ``latency_p99_ms`` (from at
  most :data:`LATENCY_RESERVOIR` latencies kept per point, a uniform sample beyond);
* what the statistics route reports (``model.stats()``, read on the worker thread when the point
  closes): the counted ``samples`` and ``forwards_per_sample`` (since the state began; with
  ``forwards_per_sample_interval`` over the point alone), the budget's credit ``budget_fill``
  (a share of its bucket, 0..1), ``drift`` ||theta - theta0||, ``mean_entropy`` of the last
  batch (nats), the guard's windowed ``entropy`` (/ ln K) and ``alignment`` distance, the
  guard's counters (``trips``, ``audits``, ``verdicts_*``), the input detector's
  ``input_changes``, the activation shift's ``shift_changes`` and the domain bank's
  ``bank_hits``;
* the guard's state (:func:`guard_state`) at its end, and every state its batches left the
  guard in (``guard_states_seen``: a pause shorter than the interval is not missed).

Recording costs the request path O(1) (:meth:`AdaptationSeries.record_request`, a lock and a
few additions); a point closes on the worker thread after a served batch once its interval is
over (:meth:`AdaptationSeries.close_if_due`: one ``model.stats()`` per interval) or, while no batch
comes, when the series is read (the route closes a due point on the worker thread, as the
statistics route reads). The ring is preallocated (``capacity`` x :data:`FIELDS` floats, the
events a deque of at most :data:`EVENT_CAPACITY`): its memory does not grow with the requests.
Events (a trip with its reason, a verdict, an audit, a change of stream, a bank hit, a state
replaced) are read off the counters' changes between two points.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..policy import Policy

SERIES_INTERVAL_S = 1.0  # seconds a point covers at least
SERIES_CAPACITY = 3600  # points kept: an hour at one a second
MAX_INTERVAL_S = 3600.0
MAX_CAPACITY = 1 << 20
LATENCY_RESERVOIR = 4096  # request latencies kept per point for its percentiles
EVENT_CAPACITY = 1024  # events kept (trips, verdicts, changes, ...)
REASON_CHARS = 200  # a trip's reason is cut here

# The guard's states, in the order of their codes in the ring
GUARD_STATES = ("adapting", "dueling", "paused", "holding", "frozen", "off")
"""``adapting``: steps run as the budget allows; ``dueling``: a guard pause or audit running a
candidate theta beside theta0; ``paused``: the guard's pause at theta0 (one forward per sample);
``holding``: the guard serves theta0 on a stream theta0's own signals fail (black frames,
noise); ``frozen``: stopped by hand (``POST freeze``); ``off``: the method never adapts
(NoAdapt, a budget of 1). The series, ``/metrics`` (``eva0_adaptation_state``) and ``top``
all read :func:`guard_state`."""

# The columns of a point (numbers; NaN: not defined, JSON null)
FIELDS = (
    "t", "seconds", "requests", "images", "images_per_s", "latency_p50_ms", "latency_p99_ms",
    "samples", "forwards", "forwards_per_sample", "forwards_per_sample_interval", "budget_fill",
    "drift", "mean_entropy", "entropy", "alignment", "guard_state", "guard_states_seen", "steps",
    "trips", "audits",
    "verdicts_checkpoint", "verdicts_theta0", "verdicts_hold", "input_changes", "shift_changes",
    "bank_hits",
)
_COLUMN = {name: i for i, name in enumerate(FIELDS)}
# the names of the states in each bit set of ``guard_states_seen``
_STATE_SETS = [[state for i, state in enumerate(GUARD_STATES) if mask >> i & 1]
               for mask in range(1 << len(GUARD_STATES))]
# the columns that count (integers in JSON)
COUNTS = frozenset({
    "requests", "images", "samples", "forwards", "steps", "trips", "audits",
    "verdicts_checkpoint", "verdicts_theta0", "verdicts_hold", "input_changes", "shift_changes",
    "bank_hits",
})
# counters whose rise between two points is an event: (field, kind)
_EVENT_COUNTERS = (
    ("trips", "trip"), ("audits", "audit"), ("verdicts_checkpoint", "verdict"),
    ("verdicts_theta0", "verdict"), ("verdicts_hold", "verdict"),
    ("input_changes", "stream_change"), ("shift_changes", "stream_change"),
    ("bank_hits", "bank_hit"),
)


def guard_state(model: Policy) -> str:
    """What the adaptation does now, one of :data:`GUARD_STATES` (read on the thread that owns
    the model; O(1) outside a guard's pause, where theta is compared with theta0): ``frozen``
    (an admin froze it), ``off`` (a method or budget that never adapts: one forward per
    sample), ``holding`` (the guard's last verdict was hold: theta0 serves while its own
    signals are out of bounds), ``dueling`` (an audit, or a pause after a trip duelling the
    checkpoint against theta0), ``paused`` (a pause with nothing to duel: theta0), else
    ``adapting``."""
    if model.model.frozen:
        return "frozen"
    if model.one_forward:
        return "off"
    if not (model.spec.guard and model.state.pause_left):
        return "adapting"
    guard = model.guard
    if guard is not None and guard.holding:
        return "holding"
    if guard is not None and (guard.auditing or not np.array_equal(model.state.theta,
                                                                  model.metadata.theta0)):
        return "dueling"
    return "paused"


def _number(value: Any) -> float:
    """A statistic as a float; NaN for None (not defined yet)."""
    return math.nan if value is None else float(value)


def reading(model: Policy, stats: dict[str, Any]) -> dict[str, float]:
    """The model's side of a point from ``stats`` (``model.stats()``), by field name."""
    guard = stats.get("guard") or {}
    signals = guard.get("signals") or {}
    verdicts = guard.get("pause_verdicts") or {}
    budget = stats.get("budget") or {}
    shift = stats.get("activation_shift") or {}
    bank = stats.get("bank") or {}
    return {
        "samples": _number(stats.get("samples")), "forwards": _number(stats.get("forwards")),
        "forwards_per_sample": _number(stats.get("forwards_per_sample")),
        "budget_fill": _number(budget.get("fill")), "drift": _number(stats.get("drift")),
        "mean_entropy": _number(stats.get("mean_entropy")),
        "entropy": _number(signals.get("entropy")),
        "alignment": _number(signals.get("alignment")),
        "guard_state": float(GUARD_STATES.index(guard_state(model))),
        "steps": _number(stats.get("steps")), "trips": _number(guard.get("trips")),
        "audits": _number(guard.get("audits")),
        **{f"verdicts_{v}": _number(verdicts.get(v)) for v in ("checkpoint", "theta0", "hold")},
        "input_changes": float(model.inputs.changes),
        "shift_changes": _number(shift.get("stream_changes")),
        "bank_hits": _number(bank.get("hits")),
    }


def bounds_of(model: Policy) -> dict[str, float | None]:
    """The lines the dashboard draws: the budget (forwards per sample) and the guard's bounds
    on drift, entropy (/ ln K) and alignment (None: off)."""
    budget = model.budget
    guard = model.guard
    b = guard.bounds if guard is not None else None
    return {
        "budget": None if budget is None else budget.budget,
        "drift_max": None if b is None else b.drift_max,
        "entropy_min": None if b is None else b.entropy_min,
        "entropy_max": None if b is None else b.entropy_max,
        "alignment_max": None if b is None else b.alignment_max,
    }


@dataclass(frozen=True)
class Event:
    """Something a point's counters say happened in it: ``t`` (seconds since the epoch, the
    point's end), ``kind`` (trip, audit, verdict, stream_change, bank_hit, state_replaced),
    ``detail`` (a trip's reason, a verdict's name, a count)."""

    t: float
    kind: str
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {"t": self.t, "kind": self.kind, "detail": self.detail}


class AdaptationSeries:
    """The ring of points (see the module). ``interval_s``: seconds a point covers at least
    (> 0, at most an hour); ``capacity``: points kept (1 .. 2^20); ``clock`` / ``wall``:
    monotonic and epoch seconds (tests pass their own; a point's ``t`` is the epoch at the start
    plus the monotonic seconds since, so it never goes back with the wall clock)."""

    def __init__(
        self, interval_s: float = SERIES_INTERVAL_S, capacity: int = SERIES_CAPACITY,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:
        if not (isinstance(interval_s, (int, float)) and 0 < interval_s <= MAX_INTERVAL_S):
            raise ValueError(f"series interval must be > 0 and <= {MAX_INTERVAL_S:g} s, "
                             f"got {interval_s!r}")
        if isinstance(capacity, bool) or not (
                isinstance(capacity, int) and 1 <= capacity <= MAX_CAPACITY):
            raise ValueError(f"series capacity must be an integer in 1..{MAX_CAPACITY}, "
                             f"got {capacity!r}")
        self.interval_s = float(interval_s)
        self.capacity = capacity
        self._clock = clock
        self._epoch = wall() - clock()  # t: epoch seconds that never go back with the wall clock
        self._lock = threading.Lock()
        self._ring = np.full((capacity, len(FIELDS)), np.nan)
        self._next = 0  # the ring's row the next point goes to
        self._count = 0  # points in the ring
        self._events: deque[Event] = deque(maxlen=EVENT_CAPACITY)
        self._latencies = np.empty(LATENCY_RESERVOIR)
        self._random = random.Random(0)
        self._previous: dict[str, float] | None = None  # the last point's model reading
        self._open_point()

    def _open_point(self) -> None:
        self._start = self._clock()
        self._requests = 0
        self._images = 0
        self._seen = 0  # latencies offered to the reservoir in this point
        self._states = 0  # the guard states seen after this point's batches (bit i: state i)

    # ------------------------------------------------------------ the request path
    def record_request(self, seconds: float, rows: int) -> None:
        """One answered request (status 200) of ``rows`` rows that took ``seconds``: O(1)."""
        with self._lock:
            self._requests += 1
            self._images += rows
            if self._seen < LATENCY_RESERVOIR:
                self._latencies[self._seen] = seconds
            else:  # a uniform sample of the point's latencies (reservoir sampling)
                slot = self._random.randrange(self._seen + 1)
                if slot < LATENCY_RESERVOIR:
                    self._latencies[slot] = seconds
            self._seen += 1

    def due(self) -> bool:
        """Whether the open point's interval is over."""
        return self._clock() - self._start >= self.interval_s

    def close_if_due(self, model: Policy) -> None:
        """Note the guard's state, and close the open point if its interval is over (on the
        worker thread: after a served batch, or when the series is read)."""
        self._states |= 1 << GUARD_STATES.index(guard_state(model))
        if self.due():
            self.close(model)

    def begin(self, values: dict[str, float]) -> None:
        """The model's reading (by field, see :func:`reading`) before the first request: the
        first point's events count from it (a trip in the first interval is an event; a
        restored state's history is not)."""
        with self._lock:
            self._previous = values

    def close(self, model: Policy) -> None:
        """Close the open point now with the model's reading (on the thread that owns the
        model: the worker's); a new point opens."""
        stats = model.stats()
        self.add(reading(model, stats), (stats.get("guard") or {}).get("last_reason"))

    def add(self, values: dict[str, float], reason: str | None = None) -> None:
        """Close the open point with the model's side ``values`` (by field, see
        :func:`reading`); ``reason``: the guard's last trip reason (for a trip event)."""
        with self._lock:
            now = self._clock()
            seconds = max(now - self._start, 1e-9)
            kept = min(self._seen, LATENCY_RESERVOIR)
            p50, p99 = (np.percentile(self._latencies[:kept], [50, 99]) * 1000.0) if kept \
                else (math.nan, math.nan)
            previous = self._previous
            served = {
                "t": self._epoch + now, "seconds": seconds, "requests": float(self._requests),
                "images": float(self._images), "images_per_s": self._images / seconds,
                "latency_p50_ms": float(p50), "latency_p99_ms": float(p99),
                "forwards_per_sample_interval": _interval_rate(values, previous),
                "guard_states_seen": float(self._states | 1 << int(values["guard_state"])),
            }
            row = self._ring[self._next]
            row[:] = np.nan
            for name, value in {**values, **served}.items():
                row[_COLUMN[name]] = value
            self._next = (self._next + 1) % self.capacity
            self._count = min(self._count + 1, self.capacity)
            self._note_events(served["t"], values, previous, reason)
            self._previous = values
            self._open_point()

    def _note_events(self, t: float, values: dict[str, float],
                     previous: dict[str, float] | None, reason: str | None) -> None:
        if previous is None:
            return
        if values["steps"] < previous["steps"] or values["samples"] < previous["samples"]:
            self._events.append(Event(t, "state_replaced", "reset or state installed"))
            return
        for name, kind in _EVENT_COUNTERS:
            rise = values[name] - previous[name]
            if not rise > 0:  # NaN (not defined) counts as no rise
                continue
            if kind == "trip":
                detail = (reason or "")[:REASON_CHARS]
            elif kind == "verdict":
                detail = name.removeprefix("verdicts_")
            else:
                detail = name
            if rise > 1:
                detail = f"{detail} (x{rise:g})"
            self._events.append(Event(t, kind, detail))

    # ------------------------------------------------------------ reading
    def points_since(self, since: float | None = None) -> dict[str, list[Any]]:
        """The points with ``t`` > ``since`` (all without), oldest first, as columns by field
        (NaN as None, counts as integers, ``guard_state`` as its name, ``guard_states_seen``
        as the names of the states the point's batches left the guard in, its end's too)."""
        with self._lock:
            order = (np.arange(self._count) + self._next - self._count) % self.capacity
            rows = self._ring[order]
        if since is not None:
            rows = rows[rows[:, _COLUMN["t"]] > since]
        columns: dict[str, list[Any]] = {}
        for name in FIELDS:
            column = rows[:, _COLUMN[name]]
            missing = np.isnan(column)
            values: list[Any]
            if name == "guard_state":
                values = [GUARD_STATES[v] for v in _codes(column, missing)]
            elif name == "guard_states_seen":
                values = [_STATE_SETS[v] for v in _codes(column, missing)]
            elif name in COUNTS:
                values = _codes(column, missing)
            else:
                values = column.tolist()
            if missing.any():
                gap: Any = [] if name == "guard_states_seen" else None
                for i in np.flatnonzero(missing).tolist():
                    values[i] = gap
            columns[name] = values
        return columns

    def events_since(self, since: float | None = None) -> list[dict[str, Any]]:
        """The events with ``t`` > ``since`` (all kept without), oldest first."""
        with self._lock:
            events = list(self._events)
        return [e.as_json() for e in events if since is None or e.t > since]

    def __len__(self) -> int:
        return self._count


def _codes(column: np.ndarray, missing: np.ndarray) -> list[int]:
    """A column of whole numbers as ints (0 where ``missing``)."""
    return np.where(missing, 0, column).astype(np.int64).tolist()


def _interval_rate(values: dict[str, float], previous: dict[str, float] | None) -> float:
    """Forwards per sample counted over the point alone (NaN without samples in it, or across a
    reset)."""
    if previous is None:
        forwards, samples = values["forwards"], values["samples"]
    else:
        forwards = values["forwards"] - previous["forwards"]
        samples = values["samples"] - previous["samples"]
    return forwards / samples if samples > 0 and forwards >= 0 else math.nan
