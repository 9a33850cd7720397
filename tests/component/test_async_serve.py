"""The asynchronous server (``serve --async-adapt``): answers from one forward at the current
theta, adaptation on answered inputs while the worker is idle, within the budget."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from eva0_edge.runtime.engine import Engine
from eva0_edge.runtime.policy import LEARN_BLOCK, AdaptationPass, Policy
from eva0_edge.runtime.server.worker import AdaptationWorker
from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import SHIPPED_VIT

MODEL = SHIPPED_VIT
NO_SHIFT = {"activation_shift": 0.0, "guard": False}


def images(count: int, seed: int) -> np.ndarray:
    """Normalised random images [count, 3, 32, 32] within the model's range."""
    pixels = np.random.default_rng(seed).uniform(0, 1, (count, 3, 32, 32)).astype(np.float32)
    return (pixels - 0.5) / 0.5


def wait_for(condition, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def started():
    workers = []

    def start(model, **kwargs) -> AdaptationWorker:
        worker = AdaptationWorker(model, kwargs.pop("max_batch", 8), 0.0, asynchronous=True,
                                  **kwargs)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop(30)


def test_an_answer_is_the_forward_at_theta_before_its_own_adaptation(started):
    """The first request is answered at theta0; the idle pass then adapts on it (its 4 rows
    fill a pass); the next request is answered at exactly the theta that pass left."""
    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    reference = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    worker = started(model, max_batch=4)
    first, second = images(4, 0), images(4, 1)
    np.testing.assert_allclose(worker.submit(first).result(30), reference.predict(first),
                               rtol=1e-6, atol=1e-6)
    wait_for(lambda: worker.counts()["adapted_samples"] == 4)
    theta = worker.call(lambda m: m.state.theta.copy()).result(30)
    assert not np.array_equal(theta, model.metadata.theta0)
    reference.state.theta = theta
    np.testing.assert_allclose(worker.submit(second).result(30), reference.predict(second),
                               rtol=1e-6, atol=1e-6)
    wait_for(lambda: worker.counts()["adapted_samples"] == 8)
    stats = worker.call(lambda m: m.stats()).result(30)
    assert stats["samples"] == 8 and stats["steps"] == 2
    assert stats["forwards"] == 8 + 2 * 8  # each sample served once, then adapted on (2 rows)


def test_no_input_is_adapted_on_before_its_request_is_answered(started):
    model = Policy.load(MODEL, "eva0", {"guard": False}, provider="cpu")
    worker = started(model)
    submitted: list[tuple[np.ndarray, object]] = []
    lock = threading.Lock()
    early: list[int] = []
    begin = model.begin_pass

    def watched(x: np.ndarray):
        with lock:
            for rows, future in submitted:
                if not future.done() and any(np.array_equal(r, x_row) for r in rows
                                             for x_row in x):
                    early.append(rows.shape[0])
        return begin(x)

    model.begin_pass = watched

    def client(seed: int) -> None:
        for i in range(6):
            x = images(1 + (seed + i) % 3, 100 * seed + i)
            with lock:
                future = worker.submit(x)
                submitted.append((x, future))
            future.result(30)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    served = sum(rows.shape[0] for rows, _ in submitted)
    # settled: no pass running, and fewer rows waiting than start one (max_batch)
    wait_for(lambda: worker.call(lambda m: worker.counts()).result(30)["adapting_samples"] == 0
             and worker.counts()["waiting_samples"] < 8)
    counts = worker.call(lambda m: worker.counts()).result(30)
    assert early == [] and counts["served_samples"] == served and counts["adapted_samples"] > 0
    assert sum(counts.values()) == 2 * served  # each sample served, then adapted on or dropped


def blocky(count: int, seed: int) -> np.ndarray:
    """Images [count, 3, 32, 32] of 4 x 4 blocks: a stream the activation shift moves (random
    pixels it leaves alone)."""
    return np.repeat(np.repeat(images(count, seed)[:, :, :8, :8], 4, axis=2), 4, axis=3)


def test_small_batches_are_learnt_from_in_blocks():
    """Batches under ``LEARN_BLOCK`` rows are served with the windows the last block left and
    learnt from once the block is full: the windows, the budget's credit and the forward
    counter then read as if the block had come as one batch."""
    config = {"budget": 1.5, "guard": False}
    blocks, whole = (Policy.load(MODEL, "eva0", config, provider="cpu") for _ in range(2))
    plain = Policy.load(MODEL, "noadapt", provider="cpu")
    for model in (blocks, whole):
        model.set_asynchronous()
        for seed in range(8):
            model.serve_step(blocky(LEARN_BLOCK, seed))
        model.budget.credit = 100.0  # room below the cap, so what is earned shows
    credit, weight = blocks.budget.credit, blocks.state.shift_weight
    parts = [blocky(2, 100 + i) for i in range(LEARN_BLOCK // 2)]
    offsets = []
    for part in parts[:-1]:
        offsets.append(blocks.serve_step(part) - plain.predict(part))
        assert (blocks.budget.credit, blocks.state.shift_weight) == (credit, weight)
    assert np.abs(offsets[0]).max() > 0.5
    for offset in offsets[1:]:
        np.testing.assert_allclose(offset[0], offsets[0][0], atol=1e-5)
    blocks.serve_step(parts[-1])
    whole.serve_step(np.concatenate(parts))
    np.testing.assert_array_equal(blocks.state.shift_mean, whole.state.shift_mean)
    assert blocks.budget.credit == whole.budget.credit == credit + 0.5 * LEARN_BLOCK
    assert blocks.stats()["samples"] == whole.stats()["samples"] == 9 * LEARN_BLOCK


def test_what_reads_the_state_sees_the_served_samples_learnt_from(started):
    """Three single images wait for their block; a control operation learns from them first,
    so the activation shift's window holds them."""
    model = Policy.load(MODEL, "eva0", {"budget": 1.5, "guard": False}, provider="cpu")
    worker = started(model, max_batch=64)
    for seed in range(3):
        worker.submit(blocky(1, seed)).result(30)
    weight, samples = worker.call(lambda m: (m.state.shift_weight, m.stats()["samples"])).result(30)
    assert samples == 3 and weight == pytest.approx(1 - model.shift.factor**3)


def held_passes(monkeypatch) -> tuple[threading.Event, list[tuple[int, int]]]:
    """Make every pass's ORT call (``AdaptationPass.call``) wait for the returned event; the
    list collects each call's thread id and that thread's scheduling policy."""
    release, seen = threading.Event(), []
    call = AdaptationPass.call

    def held(adaptation):
        seen.append((threading.get_ident(), os.sched_getscheduler(threading.get_native_id())))
        assert release.wait(30)
        return call(adaptation)

    monkeypatch.setattr(AdaptationPass, "call", held)
    return release, seen


def test_serving_goes_on_while_a_pass_runs(started, monkeypatch):
    """A running pass holds no request: the next batch is answered at the theta before the
    pass, by the worker, while the pass's ORT call runs on the pass thread (scheduled only on
    idle CPU); the update lands once the call is done."""
    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    reference = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    release, seen = held_passes(monkeypatch)
    worker = started(model, max_batch=4)
    worker.submit(images(4, 0)).result(30)
    wait_for(lambda: seen != [])
    later = images(4, 1)
    np.testing.assert_allclose(worker.submit(later).result(30), reference.predict(later),
                               rtol=1e-6, atol=1e-6)
    counts = worker.call(lambda m: worker.counts()).result(30)
    assert counts["adapting_samples"] == 4 and counts["adapted_samples"] == 0
    ((thread, policy),) = seen
    assert thread != worker._thread.ident and policy == os.SCHED_IDLE
    release.set()
    wait_for(lambda: worker.counts()["adapted_samples"] == 4)
    assert worker.call(lambda m: m.state.step).result(30) == 1


def test_a_pass_estimate_is_computed_on_its_own_thread_at_normal_priority(started, monkeypatch):
    """The losses and the gradient from a pass's ORT call (``Engine.estimate_served``) run on
    a thread of their own at the normal policy, neither the worker nor the pass thread (NumPy
    holds the GIL between its calls, and a thread on idle CPU only that holds it makes the
    answers wait for CPU it may not get): while they are held the worker answers the next
    batch, and the update lands once they are done."""
    release, seen, calls = threading.Event(), [], []
    estimate, call = Engine.estimate_served, AdaptationPass.call

    def recorded_call(adaptation):
        calls.append(threading.get_ident())
        return call(adaptation)

    def held(engine, served, outputs):
        seen.append((threading.get_ident(), os.sched_getscheduler(threading.get_native_id())))
        assert release.wait(30)
        return estimate(engine, served, outputs)

    monkeypatch.setattr(AdaptationPass, "call", recorded_call)
    monkeypatch.setattr(Engine, "estimate_served", held)
    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    worker = started(model, max_batch=4)
    worker.submit(images(4, 0)).result(30)
    wait_for(lambda: seen != [])
    worker.submit(images(4, 1)).result(30)
    ((thread, policy),) = seen
    assert thread not in (worker._thread.ident, calls[0]) and policy == os.SCHED_OTHER
    assert worker.counts()["adapted_samples"] == 0
    release.set()
    wait_for(lambda: worker.counts()["adapted_samples"] >= 4)


def test_a_pass_runs_single_threaded_on_its_thread(started, monkeypatch):
    """On a multi-threaded session the pass's ORT call runs on the pass thread on a
    single-threaded session (none of it on the serving session's intra-op threads, which run
    at normal priority), counted by the same forward counter, while the answers keep the
    serving session's threads; its update is the one a single-threaded server's pass makes,
    bit for bit."""
    calls = []
    run = AdaptableSession.run

    def recorded_run(session, x, theta):
        calls.append((threading.get_ident(), session.threads, theta.shape[0]))
        return run(session, x, theta)

    monkeypatch.setattr(AdaptableSession, "run", recorded_run)
    thetas = []
    for threads in (2, 1):
        calls.clear()
        model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu", threads=threads)
        worker = started(model, max_batch=4)
        worker.submit(images(4, 0)).result(30)
        wait_for(lambda w=worker: w.counts()["adapted_samples"] == 4)
        worker_thread = worker._thread.ident
        (pass_call,) = [c for c in calls if c[2] == model.config.forwards * 4]
        assert pass_call[0] != worker_thread and pass_call[1] == 1
        served = [c for c in calls if c[2] == 4]
        assert served and all(c[0] == worker_thread and c[1] == threads for c in served)
        assert model.session.counter.forwards == 4 + model.config.forwards * 4
        thetas.append(worker.call(lambda m: m.state.theta.copy()).result(30))
    np.testing.assert_array_equal(thetas[0], thetas[1])
    assert not np.array_equal(thetas[0], model.metadata.theta0)


@pytest.mark.parametrize("move", [
    lambda m: m.reset(),
    lambda m: m.model.roll_back(m.metadata.theta0),  # the guard's: the same state object
    lambda m: m.load_state_bytes(m.state_bytes()),
    lambda m: (m.freeze(True), m.freeze(False)),  # lifted before the pass ends (issue 50)
], ids=["reset", "roll-back", "state-installed", "freeze-lifted"])
def test_a_pass_the_state_moved_away_from_is_dropped(started, move, monkeypatch):
    """A reset, roll-back, installed state or a freeze while the pass's ORT call runs: its
    update is of a theta no longer there, or one the freeze said not to change, so it is
    dropped (counted), and theta stays theta0."""
    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    release, seen = held_passes(monkeypatch)
    worker = started(model, max_batch=4)
    worker.submit(images(4, 0)).result(30)
    wait_for(lambda: seen != [])
    worker.call(move).result(30)
    release.set()
    wait_for(lambda: worker.counts()["dropped_samples"] == 4)
    state = worker.call(lambda m: (m.state.step, m.state.theta.copy())).result(30)
    assert worker.counts()["adapted_samples"] == 0 and state[0] == 0
    np.testing.assert_array_equal(state[1], model.metadata.theta0)


def test_budget_one_serves_what_noadapt_shift_serves(started):
    """F = 1: no adaptation pass is paid for; every answer is noadapt-shift's, one forward."""
    model = Policy.load(MODEL, "eva0", {"budget": 1.0}, provider="cpu")
    reference = Policy.load(MODEL, "noadapt-shift", provider="cpu")
    worker = started(model, max_batch=3)
    for seed in range(5):
        x = images(3, seed)
        np.testing.assert_array_equal(worker.submit(x).result(30), reference.step(x))
        wait_for(lambda want=3 * (seed + 1): worker.counts()["dropped_samples"] == want)
    assert worker.counts()["adapted_samples"] == 0
    assert worker.call(lambda m: m.forwards_per_sample).result(30) == 1.0


def test_the_budget_charges_an_adapted_sample_its_forwards_beyond_the_served_one(started):
    """F = 1.5 on 1600 samples: the forward counter stays within the budget plus the bucket's
    burst (the model's ``budget_burst`` samples' worth of F - 1), though every adapted sample
    also paid its served forward."""
    model = Policy.load(MODEL, "eva0", {"budget": 1.5, "guard": False}, provider="cpu")
    worker = started(model)
    for seed in range(200):  # each request fills a pass: adapted on or declined, then the next
        worker.submit(images(8, seed)).result(30)
        wait_for(lambda done=8 * (seed + 1): worker.counts()["adapted_samples"] +
                 worker.counts()["dropped_samples"] == done)
    counts = worker.counts()
    fps = worker.call(lambda m: m.forwards_per_sample).result(30)
    assert fps == pytest.approx(1 + 2 * counts["adapted_samples"] / counts["served_samples"])
    burst = model.config.budget_burst
    assert counts["adapted_samples"] > 0 and fps <= 1.5 + 0.5 * burst / 1600 + 1e-9
    budget = worker.call(lambda m: m.stats()["budget"]).result(30)
    assert budget["adapted_samples"] == counts["adapted_samples"]
    assert 0 < budget["served_samples"] <= counts["dropped_samples"]  # declined by the budget


def test_statistics_under_load_agree_with_themselves():
    """Eight clients keep the asynchronous server busy while statistics are read: every answer
    is one snapshot, its served samples equal to the session's (issue 50: they differed by up
    to 29 rows when read in two calls)."""
    import json

    from eva0_edge.runtime.server import ServeOptions, create_app
    from tests.fixtures import InProcessServer, http_call

    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu", threads=1)
    server = InProcessServer(create_app(model, ServeOptions("m", asynchronous=True)))
    body = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                   "shape": [2, 3, 32, 32],
                                   "data": images(2, 0).ravel().tolist()}]}).encode()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            http_call(server, "POST", "/v2/models/m/infer", body)

    clients = [threading.Thread(target=client) for _ in range(8)]
    try:
        for thread in clients:
            thread.start()
        seen = set()
        for _ in range(40):
            status, answer = http_call(server, "GET", "/v2/models/m/adaptation/statistics")
            stats = json.loads(answer)
            assert status == 200
            assert stats["samples"] == stats["asynchronous"]["served_samples"]
            seen.add(stats["samples"])
        assert len(seen) > 5  # read while serving, not before or after
    finally:
        stop.set()
        for thread in clients:
            thread.join(30)
        server.stop()


def test_a_stop_abandons_a_pass_still_running_and_writes_the_last_applied_step(
        started, monkeypatch, tmp_path):
    """SIGTERM under CPU load: a pass whose ORT call gets no CPU is not waited for; the worker
    stops at once with the snapshot of the last applied step (issue 50: 15-39 s to exit), and
    gives the pass thread the normal policy back where the OS permits (the process ends only
    once that thread has run again)."""
    from eva0_edge.runtime.server.snapshots import SnapshotStore

    model = Policy.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    release, seen = held_passes(monkeypatch)
    store = SnapshotStore(tmp_path / "state")
    worker = AdaptationWorker(model, 4, 0.0, store, asynchronous=True)
    worker.start()
    try:
        worker.submit(images(4, 0)).result(30)
        wait_for(lambda: seen != [])  # the pass's ORT call is held: a starved thread
        worker.stop(timeout=10)
        assert not worker._thread.is_alive() and worker.abandoned_pass
        assert worker.counts()["dropped_samples"] == 4 and store.written == 1
        assert model.state.step == 0
        (thread,) = worker._pass_threads
        policy = os.sched_getscheduler(thread)
        assert policy == (os.SCHED_OTHER if _may_raise_priority() else os.SCHED_IDLE)
    finally:
        release.set()


def _may_raise_priority() -> bool:
    """Whether this process may raise a thread's scheduling priority (CAP_SYS_NICE)."""
    with open("/proc/self/status") as status:
        caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff"))
    return bool(caps & (1 << 23))  # CAP_SYS_NICE
