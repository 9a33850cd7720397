"""The adaptation series' ring (:mod:`eva0_edge.runtime.server.series`) on a clock of its own:
bounded, ordered, its rates, percentiles and events from what it was given."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from eva0_edge.runtime.server.series import (
    EVENT_CAPACITY,
    FIELDS,
    GUARD_STATES,
    LATENCY_RESERVOIR,
    AdaptationSeries,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def values(**given: float) -> dict[str, float]:
    """A model reading: every counter 0, drift 0, adapting, unless ``given``."""
    base = {name: 0.0 for name in FIELDS if name not in (
        "t", "seconds", "requests", "images", "images_per_s", "latency_p50_ms",
        "latency_p99_ms", "forwards_per_sample_interval", "guard_states_seen")}
    base["guard_state"] = float(GUARD_STATES.index("adapting"))
    return {**base, **given}


def make(capacity: int = 8, interval: float = 1.0) -> tuple[AdaptationSeries, Clock]:
    clock = Clock()
    return AdaptationSeries(interval, capacity, clock=clock, wall=lambda: 1000.0 + clock.now), \
        clock


def test_a_point_holds_its_requests_rate_and_latency_percentiles():
    series, clock = make()
    latencies = np.random.default_rng(0).uniform(0.001, 0.2, 500)
    for seconds in latencies:
        series.record_request(float(seconds), 4)
    assert not series.due()
    clock.now += 2.0
    assert series.due()
    series.add(values(samples=2000, forwards=3000, forwards_per_sample=1.5))
    points = series.points_since()
    assert points["requests"] == [500] and points["images"] == [2000]
    covered = points["seconds"]  # the injected clock's 2 s, not a measured time
    assert covered == [2.0] and points["images_per_s"] == [1000.0]
    assert points["t"] == [1000.0 + clock.now]
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    assert points["latency_p50_ms"] == [pytest.approx(p50)]
    assert points["latency_p99_ms"] == [pytest.approx(p99)]
    assert points["forwards_per_sample_interval"] == [1.5]
    assert points["guard_state"] == ["adapting"]
    clock.now += 1.0
    series.add(values(samples=2100, forwards=3100, forwards_per_sample=3100 / 2100))
    second = series.points_since(points["t"][0])
    assert second["requests"] == [0] and second["latency_p50_ms"] == [None]
    assert second["forwards_per_sample_interval"] == [1.0]  # 100 forwards over 100 samples


def test_percentiles_beyond_the_reservoir_come_from_a_uniform_sample():
    series, clock = make()
    latencies = np.linspace(0.0, 1.0, 4 * LATENCY_RESERVOIR)
    for seconds in latencies:
        series.record_request(float(seconds), 1)
    clock.now += 1.0
    series.add(values())
    points = series.points_since()
    assert points["requests"] == [len(latencies)]
    assert points["latency_p50_ms"][0] == pytest.approx(500.0, abs=30.0)
    assert points["latency_p99_ms"][0] == pytest.approx(990.0, abs=5.0)


def test_the_ring_keeps_the_newest_capacity_points_in_order_and_since_filters():
    series, clock = make(capacity=5)
    for i in range(12):
        clock.now += 1.0
        series.add(values(steps=i, samples=i))
    points = series.points_since()
    assert len(series) == 5 and points["steps"] == [7, 8, 9, 10, 11]
    assert points["t"] == sorted(points["t"])
    newer = series.points_since(points["t"][2])
    assert newer["steps"] == [10, 11]
    assert series.points_since(points["t"][-1])["steps"] == []


def test_counter_rises_are_events_and_a_reset_is_one():
    series, clock = make()
    clock.now += 1.0
    series.add(values(steps=5, samples=40))
    clock.now += 1.0
    series.add(values(steps=9, samples=80, trips=1, verdicts_hold=1, input_changes=2,
                      bank_hits=1), reason="alignment 0.03 above its bound 0.02")
    clock.now += 1.0
    series.add(values(steps=0, samples=0))
    events = series.events_since()
    kinds = [(e["kind"], e["detail"]) for e in events]
    assert kinds == [("trip", "alignment 0.03 above its bound 0.02"), ("verdict", "hold"),
                     ("stream_change", "input_changes (x2)"), ("bank_hit", "bank_hits"),
                     ("state_replaced", "reset or state installed")]
    t = series.points_since()["t"]
    assert [e["t"] for e in events] == [t[1]] * 4 + [t[2]]
    assert series.events_since(t[1]) == events[-1:]


def test_the_first_point_counts_its_events_from_the_reading_at_start():
    """A trip in the first interval is an event (counted from the reading before the first
    request); the history a restored state brings is not."""
    series, clock = make()
    series.begin(values(steps=30, samples=300, trips=2))
    clock.now += 1.0
    series.add(values(steps=34, samples=340, trips=3), reason="entropy below its bound")
    assert [(e["kind"], e["detail"]) for e in series.events_since()] == [
        ("trip", "entropy below its bound")]


def test_events_are_bounded():
    series, clock = make()
    for i in range(EVENT_CAPACITY + 10):
        clock.now += 1.0
        series.add(values(steps=i, trips=i))
    assert len(series.events_since()) == EVENT_CAPACITY


def test_nan_is_null_and_the_state_is_named():
    series, clock = make()
    clock.now += 1.0
    series.add(values(drift=math.nan, guard_state=float(GUARD_STATES.index("holding"))))
    points = series.points_since()
    assert points["drift"] == [None] and points["guard_state"] == ["holding"]
    assert points["guard_states_seen"] == [["holding"]]


@pytest.mark.parametrize("interval, capacity", [
    (0, 10), (-1.0, 10), (math.nan, 10), (math.inf, 10), (1.0, 0), (1.0, 2.5), (1.0, True),
    (1.0, 1 << 21),
])
def test_bad_settings_are_refused(interval, capacity):
    with pytest.raises(ValueError, match="series (interval|capacity)"):
        AdaptationSeries(interval, capacity)


def test_a_million_requests_cost_under_10_mb():
    """10^6 requests, 16 rows each, over 10^4 simulated seconds (a point each: the default
    hour's ring wraps almost three times) with a trip every 100 points: what the series holds
    stays under 10 MB (tracemalloc, everything allocated from before the series is made)."""
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        clock = Clock()
        series = AdaptationSeries(clock=clock)
        for i in range(10**6):
            series.record_request(0.001 + 1e-6 * (i % 1000), 16)
            clock.now += 0.01
            if series.due():
                points = len(series) + 1
                series.add(values(steps=points, samples=16 * i, trips=points // 100),
                           reason="entropy 0.9 above its bound 0.8")
        current, _ = tracemalloc.get_traced_memory()
        grown = sum(stat.size_diff for stat in
                    tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert len(series) == series.capacity
    assert grown < 10 * 2**20, f"the series holds {grown / 2**20:.1f} MiB after 10^6 requests"
    assert current < 10 * 2**20


def test_a_full_ring_does_not_grow_with_more_points():
    """Once the ring is full, 3x its capacity more points (each with requests and a trip)
    add nothing: what a week of points would leak shows up here in a few thousand."""
    series, clock = make(capacity=1000)

    def run(points: int) -> None:
        for _ in range(points):
            series.record_request(0.002, 8)
            clock.now += 1.0
            steps = len(series) + clock.now
            series.add(values(steps=steps, trips=steps), reason="drift 7 above its bound 6")

    run(2000)  # full, and the events' deque too
    tracemalloc.start()
    try:
        run(2000)  # every point and event now allocated under tracing
        before = tracemalloc.take_snapshot()
        run(3000)
        grown = sum(stat.size_diff for stat in
                    tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 64 * 2**10, f"{grown} bytes more after 3000 more points"
