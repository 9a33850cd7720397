"""The health guard's parts on made-up logits and features, number by number: the bounds, the
signal and feature windows, the pause's duel and its verdicts. Fast (no model, no data); the
guard on real streams is tests/integration/test_guard.py."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.guard import (
    FeatureWindow,
    GuardBounds,
    HealthGuard,
    SignalWindows,
    alignment_distance,
)
from eva0_edge.runtime.losses import softmax_entropy
from eva0_edge.runtime.rates import window_factor

NONE = dict.fromkeys(("entropy_min", "entropy_max", "spread_min", "logit_norm_min",
                      "logit_norm_max", "drift_max", "alignment_max"))


def bounds(**given) -> GuardBounds:
    return GuardBounds(**{**NONE, **given})


def test_a_bound_trips_past_it_not_on_it_and_none_is_not_checked():
    b = bounds(entropy_min=0.2, logit_norm_max=5.0)
    assert b.violation({"entropy": 0.2, "logit_norm": 5.0}) is None
    assert b.violation({"entropy": 0.19, "logit_norm": 5.0}) == \
        "entropy 0.19 below its bound 0.2"
    assert b.violation({"entropy": 0.5, "logit_norm": 5.1}) == \
        "logit_norm 5.1 above its bound 5"
    assert b.violation({"alignment": None, "logit_norm": 6.0}).startswith("logit_norm")
    assert b.violation({"drift": 1e9, "spread": -1.0}) is None  # not bounded here
    assert bounds(drift_max=1.0).violation({"drift": 2.0}) == "drift 2 above its bound 1"


def test_signal_windows_are_the_mean_entropy_norm_and_class_shares():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.0, 4.0, 0.0]])
    windows = SignalWindows(window_factor(1e9))  # a window longer than the stream: plain means
    windows.add(logits[:2])
    windows.add(logits[2:])
    assert windows.samples == 4
    assert windows.entropy == pytest.approx(softmax_entropy(logits).mean() / np.log(3))
    assert windows.logit_norm == pytest.approx(np.linalg.norm(logits, axis=1).mean())
    np.testing.assert_allclose(windows.shares, [0.25, 0.5, 0.25])
    p = np.array([0.25, 0.5, 0.25])
    assert windows.spread() == pytest.approx(-(p * np.log(p)).sum() / np.log(3))
    one_class = SignalWindows(window_factor(1e9))
    one_class.add(np.array([[5.0, 0.0], [4.0, 1.0]]))
    assert one_class.spread() == pytest.approx(0.0, abs=1e-7)  # an empty class counts 0


def test_feature_window_moments_and_their_distance_to_the_source():
    window = FeatureWindow(window_factor(1e9))
    assert window.distance((np.zeros(2), np.ones(2))) is None  # nothing seen yet
    h = np.array([[1.0, 2.0], [3.0, -2.0]])
    window.add(h)
    np.testing.assert_allclose(window.moments, [2.0, 0.0, 5.0, 4.0], atol=1e-6)
    source = (np.array([1.0, 1.0]), np.array([1.0, 1.0]))
    expected = alignment_distance(np.array([2.0, 0.0]), np.array([5.0, 4.0]), *source)
    assert window.distance(source) == pytest.approx(expected)
    assert expected == pytest.approx(((1 + 1) + (0 + 1)) / 2, rel=1e-6)  # sigma = (1, 2)
    window.add(np.array([[5.0, 4.0], [-1.0, 0.0]]))  # the same width: one window of four
    np.testing.assert_allclose(window.moments, [2.0, 1.0, 9.0, 6.0], atol=1e-6)
    window.add(np.ones((1, 3)))  # another width: the window restarts
    np.testing.assert_allclose(window.moments, np.ones(6))


def _guard(**given) -> HealthGuard:
    return HealthGuard(bounds(**given), window=1e9, warmup=4, checkpoint_every=8,
                       source_stats=(np.zeros(2), np.ones(2)), margin=2.0, change_margin=1.0)


def _batch(confident: bool, rows: int = 4, classes: int = 4) -> np.ndarray:
    """Logits of rows spread over the classes, confident (entropy ~0) or flat (~1)."""
    logits = np.zeros((rows, classes))
    if confident:
        logits[np.arange(rows), np.arange(rows) % classes] = 20.0
    return logits


def test_a_duel_splits_the_rows_between_the_candidate_and_theta0():
    guard = _guard()
    logits = np.vstack([_batch(True), _batch(False)])
    features = np.vstack([np.full((4, 2), 3.0), np.zeros((4, 2))])
    guard.observe_pause(logits, features, dueled=True)
    assert guard.windows.samples == guard.source_windows.samples == 4
    assert guard.windows.entropy < 0.01 < 0.99 < guard.source_windows.entropy
    np.testing.assert_allclose(guard.features.moments, [3, 3, 9, 9])
    np.testing.assert_allclose(guard.source_features.moments, [0, 0, 0, 0])
    alone = _guard()
    alone.observe_pause(logits, features, dueled=False)  # the candidate is theta0: all rows
    assert alone.windows.samples == 8 and alone.source_windows.samples == 0


@pytest.mark.parametrize("candidate_features,source_ok,verdict,kept", [
    (0.5, True, "checkpoint", False),  # both healthy, the candidate near the source
    (3.0, True, "theta0", False),  # healthy but over margin x theta0's distance
    (0.5, False, "hold", True),  # theta0 fails the stream: hold, keep a close candidate
    (9.0, False, "hold", False),  # ... and drop a far one
])
def test_the_pause_verdict(candidate_features, source_ok, verdict, kept):
    guard = _guard(entropy_max=0.5)
    source = _batch(True) if source_ok else _batch(False)
    logits = np.vstack([_batch(True), source])
    features = np.vstack([np.full((4, 2), candidate_features), np.full((4, 2), 1.0)])
    guard.observe_pause(logits, features, dueled=True)
    assert guard.pause_verdict(dueled=True, needed=4) == verdict
    assert guard.hold_candidate is kept and guard.holding is (verdict == "hold")
    assert guard.verdicts[verdict] == 1 and guard.windows.samples == 0  # windows restart
    assert guard.last_duel[0] == pytest.approx(alignment_distance(  # sqrt of a rounded 0: 1e-4
        np.full(2, candidate_features), np.full(2, candidate_features**2), np.zeros(2),
        np.ones(2)), rel=1e-4)


def test_a_side_with_too_few_samples_is_not_healthy():
    guard = _guard(entropy_max=0.5)
    guard.observe_pause(np.vstack([_batch(True), _batch(True)]), np.ones((8, 2)), dueled=True)
    assert guard.pause_verdict(dueled=True, needed=5) == "hold"  # 4 < 5 samples each side
    alone = _guard(entropy_max=0.5)
    alone.observe_pause(_batch(True), np.ones((4, 2)), dueled=False)
    assert alone.pause_verdict(dueled=False, needed=4) == "theta0"
    flat = _guard(entropy_max=0.5)
    flat.observe_pause(_batch(False), np.ones((4, 2)), dueled=False)
    assert flat.pause_verdict(dueled=False, needed=4) == "hold"


def test_observe_waits_for_warmup_then_trips_or_checkpoints():
    guard = _guard(entropy_max=0.5)
    assert guard.observe(_batch(True, rows=2), 0.0, None) == (None, False)  # 2 < warmup 4
    assert guard.observe(_batch(True, rows=2), 0.0, None) == (None, False)  # checked: 2 healthy
    assert guard.observe(_batch(True, rows=4), 0.0, None) == (None, False)  # 6 healthy
    assert guard.observe(_batch(True, rows=2), 0.0, None) == (None, True)  # 8: checkpoint
    assert guard.observe(_batch(True, rows=4), 0.0, None) == (None, False)  # counting again
    assert guard.observe(_batch(True, rows=3), 0.0, None) == (None, False)  # 7
    assert guard.observe(_batch(True, rows=1), 0.0, None) == (None, True)  # 8
    counted = _guard(entropy_max=0.5)
    counted.observe(_batch(True, rows=4), 0.0, None)  # the first check: 4 healthy
    assert counted.observe(_batch(True, rows=3), 0.0, None) == (None, False)  # 7 < 8
    tripped = _guard(entropy_max=0.5, drift_max=1.0)
    tripped.observe(_batch(True, rows=4), 0.0, None)
    reason, due = tripped.observe(_batch(True, rows=4), 2.0, None)
    assert reason == "drift 2 above its bound 1" and not due


def _duel(guard: HealthGuard, candidate: np.ndarray, candidate_features: float,
          source_features: float = 0.5) -> str:
    logits = np.vstack([candidate, _batch(True)])
    features = np.vstack([np.full((4, 2), candidate_features), np.full((4, 2), source_features)])
    guard.observe_pause(logits, features, dueled=True)
    return guard.pause_verdict(dueled=True, needed=4)


def test_each_signal_of_a_side_counts_in_the_verdict():
    """theta0 healthy everywhere; the candidate breaks one bound at a time and loses."""
    assert _duel(_guard(alignment_max=2.0), _batch(True), 1.0) == "checkpoint"  # 2.0: on it
    assert _duel(_guard(alignment_max=2.0), _batch(True), 1.1) == "theta0"  # 2.21, margin ok
    one_class = np.tile([[20.0, 0.0, 0.0, 0.0]], (4, 1))
    assert _duel(_guard(spread_min=0.5), one_class, 0.5) == "theta0"
    assert _duel(_guard(logit_norm_max=30.0), _batch(True) * 2, 0.5) == "theta0"  # 40 vs 20
    assert _duel(_guard(logit_norm_max=50.0), _batch(True) * 2, 0.5) == "checkpoint"


def test_without_source_statistics_a_healthy_candidate_wins_on_its_signals():
    guard = HealthGuard(bounds(entropy_max=0.5), window=1e9, warmup=4, checkpoint_every=8)
    assert _duel(guard, _batch(True), 50.0) == "checkpoint"
    assert guard.last_duel == (None, None)
    alone = _guard(entropy_max=0.5)
    alone.last_duel = (1.0, 2.0)
    alone.observe_pause(_batch(True), np.ones((4, 2)), dueled=False)
    alone.pause_verdict(dueled=False, needed=4)
    assert alone.last_duel == (None, None)  # no duel, no distances


def test_observed_signals_trip_each_bound_by_name():
    cases = [(bounds(entropy_max=0.5), _batch(False), 0.0, None),
             (bounds(spread_min=0.5), np.tile([[20.0, 0.0, 0.0, 0.0]], (4, 1)), 0.0, None),
             (bounds(logit_norm_max=10.0), _batch(True), 0.0, None),
             (bounds(alignment_max=1.0), _batch(True), 0.0, 3.0),
             (bounds(drift_max=1.0), _batch(True), 1.5, None)]
    for b, logits, drift, alignment in cases:
        guard = HealthGuard(b, window=1e9, warmup=4, checkpoint_every=8)
        reason, _ = guard.observe(logits, drift, alignment)
        name = next(k.rsplit("_", 1)[0] for k, v in b.__dict__.items() if v is not None)
        assert reason is not None and reason.startswith(name), (name, reason)
    assert HealthGuard(bounds(), 1e9, 4, 8).values(0.0, None) == dict.fromkeys(
        ("entropy", "spread", "logit_norm", "drift", "alignment"))


def test_a_second_trip_within_a_window_of_the_first_goes_to_theta0():
    guard = HealthGuard(bounds(), window=10, warmup=4, checkpoint_every=8)
    guard.since_checkpoint = 5
    assert guard.tripped("entropy low") is False  # the first trip: to the checkpoint
    assert (guard.since_rollback, guard.since_checkpoint, guard.last_reason) == (
        0, 0, "entropy low")
    guard.observe(_batch(True, rows=6), 0.0, None)
    guard.observe(_batch(True, rows=7), 0.0, None)  # 13 < warmup + window = 14
    assert guard.tripped("spread low") is True
    guard.observe(_batch(True, rows=7), 0.0, None)
    guard.observe(_batch(True, rows=7), 0.0, None)  # a full window since: healthy again
    assert guard.tripped("spread low") is False


def test_a_fresh_guard_holds_nothing_audits_nothing_and_has_no_duel():
    guard = HealthGuard(bounds(), window=1e9, warmup=4, checkpoint_every=8)
    assert (guard.holding, guard.hold_candidate, guard.auditing, guard.serving_candidate) == (
        False, False, False, False)
    assert (guard.audits, guard.last_duel, guard.last_reason) == (0, (None, None), None)
    assert guard.verdicts == {"checkpoint": 0, "theta0": 0, "hold": 0}


def test_periodic_audits_come_every_so_many_adapted_samples():
    guard = HealthGuard(bounds(), window=1e9, warmup=4, checkpoint_every=8)
    assert guard.start_audit(None) is False and guard.audits == 0  # no periodic audits
    guard.observe(_batch(True, rows=4), 0.0, None)
    guard.observe(_batch(True, rows=5), 0.0, None)
    assert guard.start_audit(10) is False and not guard.auditing  # 9 samples
    guard.observe(_batch(True, rows=1), 0.0, None)
    assert guard.start_audit(10) is True  # 10
    assert (guard.audits, guard.auditing, guard.serving_candidate) == (1, True, True)
    assert guard.windows.samples == 0  # the duel's windows start empty
    assert guard.duel_margin == 2.0  # the default margin: the candidate adapted here
    guard.observe(_batch(True, rows=9), 0.0, None)
    assert guard.start_audit(10) is False  # counted from the audit
    guard.observe(_batch(True, rows=1), 0.0, None)
    assert guard.start_audit(10) is True and guard.audits == 2


def test_a_change_of_stream_audits_at_once_serving_theta0_at_the_change_margin():
    guard = HealthGuard(bounds(), window=1e9, warmup=4, checkpoint_every=8,
                        source_stats=(np.zeros(2), np.ones(2)))
    assert guard.start_audit(None, now=True) is True
    assert (guard.audits, guard.auditing, guard.serving_candidate) == (1, True, False)
    assert guard.duel_margin == 1.0  # the default change margin
    assert _duel(guard, _batch(True), 0.5) == "checkpoint"  # as close as theta0: kept
    assert guard.last_duel[0] == guard.last_duel[1]
    assert (guard.auditing, guard.serving_candidate) == (False, False)
    assert guard.duel_margin == 2.0
    guard.start_audit(None, now=True)
    assert _duel(guard, _batch(True), 0.6) == "theta0"  # farther than theta0: dropped
    guard.start_audit(None, now=True)
    assert _duel(guard, _batch(True), 0.5) == "checkpoint"
    assert guard.verdicts == {"checkpoint": 2, "theta0": 1, "hold": 0}


def test_a_pause_counts_as_an_audit_for_the_next_periodic_one():
    guard = _guard(entropy_max=0.5)
    guard.observe(_batch(True, rows=6), 0.0, None)
    guard.tripped("entropy high")
    assert _duel(guard, _batch(True), 0.5) == "checkpoint"
    guard.observe(_batch(True, rows=9), 0.0, None)
    assert guard.start_audit(10) is False  # 9 adapted samples since the pause
    guard.observe(_batch(True, rows=1), 0.0, None)
    assert guard.start_audit(10) is True
