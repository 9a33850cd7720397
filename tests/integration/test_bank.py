"""The domain bank: a returning segment's state is restored exactly and at no forward, a segment
never seen is never restored, the memory is bounded, the budget holds with it, a wrong restore
is caught by the guard, it survives a state file and a forged one is refused (over HTTP too,
naming the field), reset empties it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.runtime.bank import MIN_SEGMENT_SAMPLES
from eva0_edge.runtime.budget import forwards_bound
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from eva0_edge.runtime.server.app import ServeOptions, create_app
from eva0_edge.runtime.state import StateError, decode_state, encode_state
from tests.component.test_budget import RESNET
from tests.fixtures import NAME, InProcessServer, http_call

SEGMENT = 256  # images per segment, over MIN_SEGMENT_SAMPLES


@pytest.fixture(scope="module")
def segments() -> dict[str, np.ndarray]:
    """Three streams the input change detector tells apart: clean test images, Gaussian noise
    of std 0.3 on them, and severity-5 contrast (each SEGMENT images, another SEGMENT each)."""
    pre = read_metadata(RESNET).preprocessing
    names = {"clean": "clean", "noise": "gauss-0.3", "contrast": "contrast"}
    out = {}
    for key, corruption in names.items():
        images, _ = corrupted_fmnist("test", corruption, 5, 2026, np.arange(2 * SEGMENT))
        out[key] = preprocess_uint8(images, pre)
    return out


def banked(slots: int = 4, **config) -> Policy:
    return Policy.load(RESNET, "eva0", {"bank_slots": slots, **config}, threads=1)


def stream(policy: Policy, x: np.ndarray, batch: int = 16) -> None:
    for i in range(0, len(x), batch):
        policy.step(x[i:i + batch])


def test_a_returning_segment_is_restored_exactly_at_no_forward(segments):
    policy = banked(guard=False)
    stream(policy, segments["clean"][:SEGMENT])
    stream(policy, segments["noise"][:SEGMENT])  # the change stores the clean segment
    bank = policy.bank
    assert bank is not None and len(bank) == 1 and bank.memories[0].samples >= MIN_SEGMENT_SAMPLES
    stored = bank.memories[0].theta.copy()
    assert not np.array_equal(stored, read_metadata(RESNET).theta0)
    stream(policy, segments["clean"][SEGMENT:SEGMENT + 16])  # the change, recalled at once
    assert bank.hits == 1 and bank.misses == 2  # the first clean and the noise segments
    np.testing.assert_array_equal(policy.state.healthy_theta, stored)  # guard off: untouched
    counter = policy.session.counter
    assert counter.forwards == 2 * counter.samples  # two per sample: the recall itself ran none
    stats = policy.stats()["bank"]
    assert stats["hits"] == 1 and stats["used"] == 2  # the noise segment was kept too


def test_a_segment_never_seen_is_never_restored(segments):
    policy = banked(guard=False)
    stream(policy, segments["clean"][:SEGMENT])
    stream(policy, segments["noise"][:SEGMENT])
    kept = [m.theta.copy() for m in policy.bank.memories]
    stream(policy, segments["contrast"][:SEGMENT])
    assert policy.bank.hits == 0 and policy.bank.misses == 3  # every segment is new
    for theta in kept:
        assert not np.array_equal(policy.state.healthy_theta, theta)


def test_the_bank_is_bounded_and_evicts_the_least_recently_used(segments):
    policy = banked(slots=2, guard=False)
    for key in ("clean", "noise", "contrast", "clean"):
        stream(policy, segments[key][:SEGMENT])
    bank = policy.bank
    assert len(bank) == 2 and bank.evictions == 1  # contrast's end evicted clean's
    assert policy.state_dict()["bank_theta"].size == 2 * read_metadata(RESNET).num_params
    assert bank.hits == 0  # clean came back after it was evicted: a miss


def test_the_budget_holds_with_the_bank_on(segments):
    policy = banked(budget=1.25)
    n = 0
    for _ in range(3):
        for key in ("clean", "noise"):
            stream(policy, segments[key][:SEGMENT])
            n += SEGMENT
    assert policy.bank.hits >= 3
    assert policy.forwards_per_sample <= forwards_bound(1.25, policy.config.budget_burst, n, 16)


def test_a_wrong_restore_is_caught_by_the_guard(segments):
    """A bank slot whose theta is bad for its segment (re-signed: theta0 plus noise of RMS 0.9
    per parameter, inside the state's limits) is recalled when the segment comes back, and the
    guard treats it as any bad theta: within its audit's warm-up theta0 serves again, and the
    rest of the segment is served much as NoAdapt serves it (over 90% the same predictions)."""
    policy = banked()
    stream(policy, segments["clean"][:SEGMENT])
    stream(policy, segments["noise"][:SEGMENT])  # stores the clean segment
    policy._sync_state()
    forged = policy.state.copy()
    theta0 = read_metadata(RESNET).theta0.astype(np.float64)
    bad = (theta0 + 0.9 * np.random.default_rng(0).normal(size=theta0.size)).astype(np.float32)
    forged.bank_theta = bad
    policy.load_state_bytes(encode_state(forged, policy.fingerprint, {}))
    reference = Policy.load(RESNET, "noadapt", threads=1)
    back = segments["clean"][SEGMENT:]
    stream(policy, back[:16])
    drift_at_recall = []
    for i in range(16, 128, 16):  # the change, its recall, the guard's answer
        policy.step(back[i:i + 16])
        drift_at_recall.append(policy.stats()["drift"])
    assert policy.bank.hits == 1
    assert max(drift_at_recall) > 0.8 * np.linalg.norm(bad - theta0)  # the bad theta came in
    assert policy.stats()["drift"] < 0.1 * np.linalg.norm(bad - theta0)  # and went out
    agree = [np.mean(policy.step(x).argmax(1) == reference.predict(x).argmax(1))
             for x in np.split(back[128:SEGMENT], 8)]
    assert np.mean(agree) > 0.9, agree


def test_the_bank_survives_a_state_file_and_a_forged_one_is_refused(segments, tmp_path):
    policy = banked(guard=False)
    stream(policy, segments["clean"][:SEGMENT])
    stream(policy, segments["noise"][:SEGMENT])
    path = policy.save_state(tmp_path / "state.npz")
    again = banked(guard=False)
    again.load_state(path)
    np.testing.assert_array_equal(again.bank.memories[0].theta, policy.bank.memories[0].theta)
    np.testing.assert_array_equal(again.bank.memories[0].key, policy.bank.memories[0].key)
    stream(again, segments["clean"][SEGMENT:SEGMENT + 48])
    assert again.bank.hits == 1  # recalled once the fresh detector's window holds 32 images
    with pytest.raises(StateError, match="bank_keys holds 1 slots; this policy keeps at most 0"):
        Policy.load(RESNET, "eva0", {"guard": False}, threads=1).load_state(path)
    state, _ = decode_state(path.read_bytes())
    far = state.copy()
    far.bank_theta = far.bank_theta + 100.0
    torn = state.copy()
    torn.bank_shift = torn.bank_shift[:-1]
    for forged, field in ((far, "bank_theta"), (torn, "bank_shift")):
        data = encode_state(forged, policy.fingerprint, {})  # re-signed
        with pytest.raises(StateError, match=field):
            again.load_state_bytes(data)
    again.reset()
    assert len(again.bank) == 0 and again.state_dict()["bank_keys"].size == 0


def test_the_server_refuses_a_forged_bank_naming_the_field(segments):
    policy = banked(guard=False)
    stream(policy, segments["clean"][:SEGMENT])
    stream(policy, segments["noise"][:SEGMENT])
    state, _ = decode_state(policy.state_bytes())
    state.bank_scalars = state.bank_scalars.copy()
    state.bank_scalars[1] = 2.0  # the first slot's shift weight, over 1
    server = InProcessServer(create_app(banked(guard=False), ServeOptions(NAME)))
    try:
        status, body = http_call(server, "PUT", f"/v2/models/{NAME}/adaptation/state",
                                 encode_state(state, policy.fingerprint, {}))
        assert status == 400
        assert "bank_scalars" in json.loads(body)["error"]
    finally:
        server.stop()
