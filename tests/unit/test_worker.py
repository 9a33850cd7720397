"""The adaptation worker's dynamic batching, on a fake model (no ORT, no server)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eva0_edge.runtime.server.worker import AdaptationWorker

LONG_DELAY_S = 30.0  # far longer than any result() timeout below: waiting it out fails a test


class FakeModel:
    """Records the rows of every step; logits = the sample's first pixel in every class."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.last = SimpleNamespace(skipped=False)
        self.state = SimpleNamespace(step=0)
        self.spec = SimpleNamespace(keeps_state=True)
        self.gate = threading.Event()  # cleared: a step blocks until it is set
        self.gate.set()
        self.entered = threading.Event()

    def health(self) -> SimpleNamespace:
        return SimpleNamespace(step=self.state.step)

    def step(self, x: np.ndarray) -> np.ndarray:
        self.entered.set()
        self.gate.wait(10)
        self.steps.append(x.shape[0])
        self.state.step += 1
        return np.repeat(x.reshape(x.shape[0], -1)[:, :1], 3, axis=1)


def rows(*values: float) -> np.ndarray:
    return np.asarray(values, np.float32).reshape(-1, 1, 1, 1)


@pytest.fixture
def worker_for():
    made = []

    def make(**kwargs) -> tuple[AdaptationWorker, FakeModel]:
        model = FakeModel()
        worker = AdaptationWorker(model, kwargs.pop("max_batch", 8), **kwargs)
        worker.start()
        made.append(worker)
        return worker, model

    yield make
    for worker in made:
        worker.stop(10)


def test_a_lone_request_is_not_held_for_the_delay(worker_for):
    worker, model = worker_for(max_delay_s=LONG_DELAY_S)
    for value in (1.0, 2.0, 3.0):  # one client: the next request only after the answer
        logits = worker.submit(rows(value)).result(timeout=5)
        assert logits.tolist() == [[value] * 3]
    assert model.steps == [1, 1, 1]


def test_the_batch_waits_for_announced_requests(worker_for):
    worker, model = worker_for(max_delay_s=LONG_DELAY_S)
    worker.announce()
    worker.announce()
    first = worker.submit(rows(1.0), announced=True)
    second = worker.submit(rows(2.0, 3.0), announced=True)
    assert first.result(timeout=5).tolist() == [[1.0] * 3]
    assert second.result(timeout=5).tolist() == [[2.0] * 3, [3.0] * 3]
    assert model.steps == [3]


def test_a_withdrawn_request_releases_the_batch(worker_for):
    worker, model = worker_for(max_delay_s=LONG_DELAY_S)
    worker.announce()
    worker.announce()
    first = worker.submit(rows(1.0), announced=True)
    worker.withdraw()  # e.g. its body was malformed
    assert first.result(timeout=5).tolist() == [[1.0] * 3]
    assert model.steps == [1]


def test_requests_queued_during_a_step_share_the_next(worker_for):
    worker, model = worker_for(max_delay_s=LONG_DELAY_S, max_batch=4)
    model.gate.clear()
    busy = worker.submit(rows(0.0))
    assert model.entered.wait(5)
    queued = [worker.submit(rows(float(i))) for i in range(1, 6)]
    model.gate.set()
    busy.result(timeout=5)
    assert [f.result(timeout=5).tolist() for f in queued] == [[[float(i)] * 3] for i in range(1, 6)]
    assert model.steps == [1, 4, 1]  # max_batch bounds the coalesced step


def test_fixed_delay_waits_for_the_deadline(worker_for):
    worker, model = worker_for(max_delay_s=0.3, adaptive_delay=False)
    first = worker.submit(rows(1.0))
    second = worker.submit(rows(2.0))
    first.result(timeout=5), second.result(timeout=5)
    assert model.steps == [2]


class SnapshotCounter:
    """A snapshot store that counts what it is asked to write."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def save(self, model) -> Path:
        self.steps.append(model.state.step)
        return Path(f"snapshot-{len(self.steps):08d}.npz")


@pytest.mark.parametrize("frozen", [False, True])
def test_snapshots_follow_the_states_steps_not_the_batches_served(worker_for, frozen):
    """Every --snapshot-every steps the state takes (issue 50: a frozen server wrote one per
    100 batches with 0 steps); a frozen state is written when the worker stops."""
    store = SnapshotCounter()
    worker, model = worker_for(snapshots=store, snapshot_every=5, max_delay_s=0.0, max_batch=1)
    if frozen:
        model.step = lambda x: np.zeros((x.shape[0], 3), np.float32)  # serves, never steps
    for i in range(12):
        worker.submit(rows(float(i))).result(timeout=10)
    assert store.steps == ([] if frozen else [5, 10])
    worker.stop(timeout=10)
    assert store.steps == ([0] if frozen else [5, 10, 12])
