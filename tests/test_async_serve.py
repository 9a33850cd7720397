"""The asynchronous server (``serve --async-adapt``): answers from one forward at the current
theta, adaptation on answered inputs while the worker is idle, within the budget."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from eva0_edge.runtime.engine import AdaptiveModel
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.server.worker import AdaptationWorker
from tests.serving import ServerProcess, http_call

MODEL = Path(__file__).resolve().parents[1] / "models" / "vit_fmnist.onnx"
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
    model = AdaptiveModel.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    reference = AdaptiveModel.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
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
    model = AdaptiveModel.load(MODEL, "eva0", {"guard": False}, provider="cpu")
    worker = started(model)
    submitted: list[tuple[np.ndarray, object]] = []
    lock = threading.Lock()
    early: list[int] = []
    begin = model.control.begin_pass

    def watched(x: np.ndarray):
        with lock:
            for rows, future in submitted:
                if not future.done() and any(np.array_equal(r, x_row) for r in rows
                                             for x_row in x):
                    early.append(rows.shape[0])
        return begin(x)

    model.control.begin_pass = watched

    def client(seed: int) -> None:
        for i in range(6):
            x = images(1 + (seed + i) % 3, 100 * seed + i)
            with lock:
                future = worker.submit(x)
                submitted.append((x, future))
            future.result(30)
            time.sleep(0.005)  # a client between requests: the worker finds idle moments

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


def test_a_served_batch_is_shifted_by_what_the_batches_before_it_taught():
    """``answer`` serves a batch with the shift the batches before it taught, whatever the
    batch holds: a batch in which the input change detector sees a new stream gets the same
    offset as one of the old stream; ``learn`` then restarts the window, and the next batch is
    served unshifted."""
    config = {"budget": 1.5, "guard": False}
    calm, jumped = (AdaptiveModel.load(MODEL, "eva0", config, provider="cpu") for _ in range(2))
    plain = load_method(MODEL, "noadapt", provider="cpu")
    for model in (calm, jumped):
        model.set_asynchronous()
        for seed in range(16):
            model.control.serve_step(blocky(8, seed))
    same, new = blocky(8, 16), images(8, 16)
    offsets = [model.control.answer(x) - plain.predict(x)
               for model, x in ((calm, same), (jumped, new))]
    assert np.abs(offsets[0]).max() > 0.5
    np.testing.assert_allclose(offsets[1], offsets[0], atol=1e-4)
    for model in (calm, jumped):
        model.control.learn()
    assert (calm.control.inputs.changes, jumped.control.inputs.changes) == (0, 1)
    after = images(8, 17)
    np.testing.assert_array_equal(jumped.control.answer(after), plain.predict(after))


def test_an_answer_goes_out_before_its_batch_is_learnt_from(started):
    """The worker answers, then learns from the batch (the detectors, the shift's window, the
    budget): with the learning held, the answer has arrived and the next batch waits for it."""
    model = AdaptiveModel.load(MODEL, "eva0", {"budget": 1.5, "guard": False}, provider="cpu")
    release, learning = threading.Event(), threading.Event()
    learn = model.learn_served

    def held(features: np.ndarray) -> bool:
        learning.set()
        assert release.wait(30)
        return learn(features)

    model.learn_served = held
    worker = started(model, max_batch=64)
    first = worker.submit(blocky(4, 0))
    assert first.result(30).shape == (4, 10) and learning.wait(30)
    second = worker.submit(blocky(4, 1))
    time.sleep(0.2)  # the worker is held in the learning: nothing is served meanwhile
    assert not second.done()
    release.set()
    assert second.result(30).shape == (4, 10)
    assert worker.call(lambda m: m.state.shift_weight).result(30) > 0


def held_passes(model: AdaptiveModel) -> tuple[threading.Event, list[tuple[int, int]]]:
    """Make the model's pass ORT calls wait for the returned event; the list collects each
    call's thread id and that thread's scheduling policy."""
    release, seen = threading.Event(), []
    run = model.run_served

    def held(served):
        seen.append((threading.get_ident(), os.sched_getscheduler(threading.get_native_id())))
        assert release.wait(30)
        return run(served)

    model.run_served = held
    return release, seen


def test_serving_goes_on_while_a_pass_runs(started):
    """A running pass holds no request: the next batch is answered at the theta before the
    pass, by the worker, while the pass's ORT call runs on the pass thread (scheduled only on
    idle CPU); the update lands once the call is done."""
    model = AdaptiveModel.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    reference = AdaptiveModel.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    release, seen = held_passes(model)
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


@pytest.mark.parametrize("move", [
    lambda m: m.reset(),
    lambda m: m.roll_back(m.metadata.theta0),  # the guard's: the same state object
    lambda m: m.load_state_bytes(m.state_bytes()),
], ids=["reset", "roll-back", "state-installed"])
def test_a_pass_the_state_moved_away_from_is_dropped(started, move):
    """A reset, roll-back or installed state while the pass's ORT call runs: its update is of a
    theta no longer there, so it is dropped (counted), and theta stays theta0."""
    model = AdaptiveModel.load(MODEL, "eva0", NO_SHIFT, provider="cpu")
    release, seen = held_passes(model)
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
    model = AdaptiveModel.load(MODEL, "eva0", {"budget": 1.0}, provider="cpu")
    reference = load_method(MODEL, "noadapt-shift", provider="cpu")
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
    model = AdaptiveModel.load(MODEL, "eva0", {"budget": 1.5, "guard": False}, provider="cpu")
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


def test_a_method_without_a_separate_step_is_refused(prompt_vit):
    model = load_method(prompt_vit.onnx_path, "foa@4", provider="cpu")
    with pytest.raises(ValueError, match="asynchronous adaptation"):
        AdaptationWorker(model, 8, 0.0, asynchronous=True)


def test_the_server_reports_served_adapted_and_dropped(tmp_path):
    """``serve --async-adapt`` through a real HTTP client: the answer, then the statistics'
    counts once the idle pass has run."""
    server = ServerProcess(tmp_path / "async.log", "--async-adapt", "--max-batch", "4",
                           model=MODEL)
    try:
        x = images(4, 0)
        tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        assert server.client.infer("vit_fmnist", [tensor]).as_numpy("logits").shape == (4, 10)

        def counts() -> dict:
            status, body = http_call(server, "GET", "/v2/models/vit_fmnist/adaptation/statistics")
            assert status == 200
            return json.loads(body)["asynchronous"]

        wait_for(lambda: counts()["adapted_samples"] == 4)
        assert counts() == {"served_samples": 4, "adapted_samples": 4, "dropped_samples": 0,
                            "adapting_samples": 0, "waiting_samples": 0}
    finally:
        server.stop()
