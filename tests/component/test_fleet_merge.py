"""The fleet's merge rule and state actor, without Ray: fake models (states and counters)
synced by the served fleet's own FleetSync, the actor called in process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from eva0_edge.fleet.merge import Report, apply_merged, feature_distance, merge, progress
from eva0_edge.fleet.state_actor import FleetConfig, FleetState
from eva0_edge.fleet.sync import FleetSync, InlineWorker, local_actor
from eva0_edge.runtime.state import AdaptState, decode_state

P, K, F = 6, 3, 4
SIZES = {"theta": P, "anchor": P, "velocity": P, "healthy_theta": P, "center": K, "mean": F,
         "second_moment": F, "shift_mean": F, "shift_recent": F}


def source() -> AdaptState:
    return AdaptState.initial(np.linspace(-1, 1, P), K, F, seed=0)


def adapted(base: AdaptState, rng: np.random.Generator, mean: float = 0.0,
            steps: int = 5) -> AdaptState:
    """``base`` after a few made-up steps on a domain whose features centre on ``mean``."""
    state = base.copy()
    state.theta = state.theta + rng.normal(0, 0.1, P).astype(np.float32)
    state.velocity = state.velocity + rng.normal(0, 0.01, P).astype(np.float32)
    state.center = state.center + rng.normal(0, 0.1, K)
    state.mean = mean + rng.normal(0, 0.05, F)
    state.second_moment = state.mean**2 + 1.0
    state.stat_weight = min(1.0, state.stat_weight + 0.2)
    state.step += steps
    return state


def test_merge_adds_progress_or_takes_its_weighted_average():
    rng = np.random.default_rng(0)
    g = source()
    a, b = adapted(g, rng), adapted(g, rng)
    reports = [Report("a", a, progress(a, g), 30), Report("b", b, progress(b, g), 10)]
    mean, kept, left_out = merge(g, reports, threshold=1.0, combine="mean")
    assert kept == ["a", "b"] and left_out == []
    np.testing.assert_allclose(mean.theta, 0.75 * a.theta + 0.25 * b.theta, rtol=1e-6)
    np.testing.assert_allclose(mean.center, 0.75 * a.center + 0.25 * b.center)
    assert mean.theta.dtype == np.float32
    total, _, _ = merge(g, reports, threshold=1.0, combine="sum")  # as one process saw both
    np.testing.assert_allclose(total.theta, a.theta + b.theta - g.theta, rtol=1e-6)
    with pytest.raises(ValueError, match="combine"):
        merge(g, reports, threshold=1.0, combine="max")


def test_applying_the_merge_keeps_local_progress_and_counters():
    rng = np.random.default_rng(1)
    g = source()
    reported = adapted(g, rng)
    reported.guard_trips, reported.clipped_coefs = 2, 7
    merged = adapted(g, rng)
    quiet = apply_merged(merged, reported, reported)
    np.testing.assert_array_equal(quiet.theta, merged.theta)  # no step since the report: exact
    assert (quiet.guard_trips, quiet.clipped_coefs, quiet.step) == (2, 7, reported.step)
    later = adapted(reported, rng)
    busy = apply_merged(merged, reported, later)
    np.testing.assert_allclose(busy.theta, merged.theta + (later.theta - reported.theta), atol=1e-6)


def test_a_replica_in_another_domain_stays_out_and_keeps_its_state():
    rng = np.random.default_rng(2)
    g = source()
    near = [adapted(g, rng, mean=0.0) for _ in range(2)]
    far = adapted(g, rng, mean=3.0)
    assert feature_distance(near[0], near[1]) < 0.2 < 2.5 < feature_distance(near[0], far)
    reports = [Report(n, s, progress(s, g), 10) for n, s in zip("abc", [*near, far], strict=True)]
    merged, kept, left_out = merge(g, reports, threshold=1.0, combine="mean")
    assert kept == ["a", "b"] and left_out == ["c"]
    np.testing.assert_allclose(merged.theta, (near[0].theta + near[1].theta) / 2, rtol=1e-6)


def _fleet(tmp_path=None) -> FleetState:
    config = FleetConfig(threshold=1.0, state_dir=str(tmp_path) if tmp_path else None)
    return FleetState(source().to_dict(), "fp", SIZES, "eva0", config)


class StateOnlyModel:
    """What :class:`~eva0_edge.fleet.sync.FleetSync` reads and writes of a model (its state,
    its image counter, its guard), with made-up steps instead of ORT calls."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.state = source()
        self.session = SimpleNamespace(counter=SimpleNamespace(samples=0))

    def state_dict(self) -> dict:
        return self.state.to_dict()

    def load_state_dict(self, values: dict) -> None:
        self.state = AdaptState.from_dict(values)

    def health(self) -> SimpleNamespace:
        return SimpleNamespace(adapting=True, guard_trips=self.state.guard_trips)

    def step(self, images: int = 4) -> None:
        self.state = adapted(self.state, self.rng, steps=1)
        self.session.counter.samples += images

    def serve(self, images: int = 4) -> None:
        """Images served without the state moving (the guard paused adaptation)."""
        self.session.counter.samples += images


class Replica:
    """A fake model synced by the served fleet's own FleetSync, in process."""

    def __init__(self, fleet: FleetState, name: str, seed: int) -> None:
        self.model = StateOnlyModel(seed)
        self.sync_ = FleetSync(local_actor(fleet), name, self.model, every_s=0)
        self.sync_.start(InlineWorker(self.model))

    @property
    def state(self) -> AdaptState:
        return self.model.state

    def step(self) -> None:
        self.model.step()

    def sync(self) -> bool:
        """Report; True when a merged state was installed."""
        applied = self.sync_.applied
        self.sync_.sync_once()
        return self.sync_.applied > applied


def test_after_a_quiet_round_every_replica_holds_the_fleet_state():
    fleet = _fleet()
    replicas = [Replica(fleet, n, i) for i, n in enumerate("abc")]
    for _ in range(4):  # interleaved steps and syncs, reports ahead of and behind merges
        for r in replicas:
            r.step()
            r.sync()
        replicas[0].step()
        replicas[0].sync()
    for r in replicas:  # the last images: one round merges them
        r.sync()
    version = fleet.version
    for _ in range(3):  # no traffic: the next round hands the merge out, and nothing moves
        for r in replicas:
            r.sync()
    assert fleet.version == version
    thetas = [r.state.theta for r in replicas]
    for theta in thetas[1:]:
        np.testing.assert_array_equal(theta, thetas[0])
    np.testing.assert_array_equal(thetas[0], fleet.state.theta)
    assert fleet.statistics()["replicas"] == 3 and fleet.version >= 5


def test_progress_is_counted_once():
    """a adapts, b idles: a's two reports before the merge add up (8 images against b's 4), so
    the fleet moves 8/12 of a's progress; later quiet rounds leave it there (nothing counted
    twice)."""
    fleet = _fleet()
    a, b = Replica(fleet, "a", 0), Replica(fleet, "b", 1)
    a.step()
    a.sync()
    a.step()
    own = a.state.theta.copy()
    a.sync()
    b.model.serve()  # b's 4 images moved nothing
    b.sync()  # the merge
    expected = source().theta + (8 / 12) * (own - source().theta)
    np.testing.assert_allclose(fleet.state.theta, expected, atol=1e-6)
    for _ in range(3):  # both serve images without moving: nothing to add
        for r in (a, b):
            r.model.serve()
            r.sync()
    assert fleet.version >= 3
    np.testing.assert_allclose(fleet.state.theta, expected, atol=1e-6)
    np.testing.assert_array_equal(a.state.theta, fleet.state.theta)


def test_an_unhealthy_replica_stays_out_but_takes_the_fleet_state():
    fleet = _fleet()
    a, b = Replica(fleet, "a", 0), Replica(fleet, "b", 1)
    a.step()
    b.step()
    a.sync()
    bad_theta = b.state.theta.copy()
    b.state.guard_trips += 1  # b's guard tripped since its last report
    assert b.sync()  # the merge: a's progress only
    np.testing.assert_array_equal(b.state.theta, a.state.theta)
    assert not np.array_equal(b.state.theta, bad_theta)
    assert fleet.statistics()["left_out_unhealthy"] == 1


def test_a_merge_that_overflows_is_refused_and_the_fleet_state_kept():
    config = FleetConfig(threshold=1.0, combine="sum")
    fleet = FleetState(source().to_dict(), "fp", SIZES, "eva0", config)
    g = source()
    big = g.copy()
    big.theta = np.full(P, 3e38, dtype=np.float32)  # finite, but two of them are not
    step = progress(big, g)
    for name in ("a", "b"):
        fleet.join(name)
    fleet.report("a", big.to_dict(), step, 1, True)
    version, merged, stats = fleet.report("b", big.to_dict(), step, 1, True)
    assert version == 0 and merged is None and stats["merges_refused"] == 1
    np.testing.assert_array_equal(fleet.state.theta, g.theta)


def test_fleet_snapshots_verify_and_a_restarted_actor_resumes(tmp_path):
    fleet = _fleet(tmp_path)
    a, b = Replica(fleet, "a", 0), Replica(fleet, "b", 1)
    for r in (a, b):
        r.step()
        r.sync()
    files = sorted(tmp_path.glob("snapshot-*.npz"))
    assert len(files) == 1
    state, info = decode_state(files[0].read_bytes(), "fp", SIZES)
    np.testing.assert_array_equal(state.theta, fleet.state.theta)
    restarted = _fleet(tmp_path)
    assert restarted.version == fleet.version == info["fleet_version"] == 1
    c = Replica(restarted, "c", 2)  # a new replica starts from the fleet state
    np.testing.assert_array_equal(c.state.theta, fleet.state.theta)


@pytest.mark.parametrize("bad", ["theta", "mean"])
def test_a_report_of_the_wrong_shape_is_refused(bad):
    fleet = _fleet()
    state = source()
    setattr(state, bad, np.zeros(2, dtype=getattr(state, bad).dtype))
    with pytest.raises(ValueError):
        fleet.report("a", state.to_dict(), progress(source(), source()), 1, True)


def test_a_replica_keeps_its_own_shift_windows_across_a_merge():
    rng = np.random.default_rng(3)
    g = source()
    a, b = adapted(g, rng), adapted(g, rng)
    a.shift_mean, a.shift_sq, a.shift_weight = np.full(F, 1.0), 4.0, 0.5
    b.shift_mean, b.shift_sq, b.shift_weight = np.zeros(F), 0.0, 0.0  # b just restarted
    reports = [Report("a", a, progress(a, g), 10), Report("b", b, progress(b, g), 10)]
    merged, kept, _ = merge(g, reports, threshold=1.0)
    assert kept == ["a", "b"]
    assert apply_merged(merged, b, b).shift_weight == 0.0  # not a's window of the old domain
    applied = apply_merged(merged, a, a)
    np.testing.assert_array_equal(applied.shift_mean, a.shift_mean)
    assert applied.shift_weight == 0.5
    np.testing.assert_array_equal(applied.theta, merged.theta)


def test_the_shift_window_is_divided_among_replicas_that_share_a_stream():
    from eva0_edge.fleet.serve import shared_stream_config
    from eva0_edge.runtime.policy import Policy
    from tests.fixtures import MODEL

    probe = Policy.load(MODEL, "eva0", threads=1)
    window = probe.config.shift_window
    assert probe.config.activation_shift > 0
    assert shared_stream_config({}, probe, 4)["shift_window"] == window / 4
    assert shared_stream_config({"eta": 0.1}, probe, 1000) == {"eta": 0.1, "shift_window": 1.0}
    own = {"shift_window": 100.0}
    assert shared_stream_config(own, probe, 4) == own  # the user's value is the replica's own
    unshifted = Policy.load(MODEL, "eva0", {"activation_shift": 0.0}, threads=1)
    assert shared_stream_config({}, unshifted, 4) == {}


def test_a_fleet_of_one_merging_with_itself_is_one_process():
    from tests.fixtures import MODEL, load_study

    sim = load_study("fleet-sim", "fleet_sim")
    fleet, one_process = sim.fleet, sim.one_process

    rng = np.random.default_rng(0)
    x = rng.uniform(-1.5, 3.0, (40, 3, 32, 32)).astype(np.float32)
    alone = one_process(str(MODEL), "eva0", {}, x, 4, seed=0)
    np.testing.assert_array_equal(fleet(str(MODEL), "eva0", {}, x, 1, 4, 0, "mean", 0), alone)
    np.testing.assert_array_equal(fleet(str(MODEL), "eva0", {}, x, 1, 4, 8, "mean", 0), alone)
