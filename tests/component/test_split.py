"""Split sessions (prefix once, suffix per theta copy) give the one-file graph's numbers for every
row layout, on float, quantized and prompt models; a memory budget sets the rows per suffix call
without changing results; the two parts load each weight once."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession
from eva0_edge.runtime.split import split_files
from tests.fixtures import SHIPPED, uniform_batch


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EVA0_CACHE", str(tmp_path / "cache"))


def _rows(theta0: np.ndarray, copies: int, n: int) -> np.ndarray:
    noise = np.random.default_rng(copies).normal(0, 0.1, (copies * n, theta0.size))
    return (theta0[None] + noise).astype(np.float32)


@pytest.mark.parametrize("path", SHIPPED)
@pytest.mark.parametrize("copies", [1, 2, 6])  # r = 1, 2 and 2q with q = 3
def test_split_equals_one_file_for_every_row_layout(path, copies):
    whole = AdaptableSession(path, provider="cpu", threads=1)
    split = AdaptableSession(path, provider="cpu", threads=1, split=True)
    x = uniform_batch(3, seed=copies, size=whole.metadata.preprocessing.input_size)
    theta = _rows(whole.metadata.theta0, copies, 3)
    for expected, got in zip(whole.run(x, theta), split.run(x, theta), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_budget_below_the_whole_call_runs_the_copies_in_several_calls():
    path = SHIPPED[0]
    tight = AdaptableSession(path, provider="cpu", split=True, memory_budget_mb=0.5)
    roomy = AdaptableSession(path, provider="cpu", split=True)  # 16 MiB: the tiny ViT fits
    assert tight.parts.rows_per_call(4, 8) == 4 and roomy.parts.rows_per_call(4, 8) == 8
    assert tight.parts.rows_per_call(1, 2) == 2  # 0.5 MiB still holds 2 rows of 0.2 MiB
    calls = []
    run = tight.parts.suffix.run
    tight.parts.suffix.run = lambda *a: calls.append(1) or run(*a)
    x = uniform_batch(4, seed=1)
    theta = _rows(tight.metadata.theta0, 2, 4)
    for expected, got in zip(roomy.run(x, theta), tight.run(x, theta), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert len(calls) == 2


def test_split_steps_equal_one_file_steps():
    path = SHIPPED[1]
    whole = Policy.load(path, "eva0", {"guard": False}, seed=2, provider="cpu")
    split = Policy.load(path, "eva0", {"guard": False}, seed=2, provider="cpu", split=True)
    for i, batch in enumerate((1, 4, 4)):
        x = uniform_batch(batch, seed=i)
        np.testing.assert_allclose(split.step(x), whole.step(x), atol=1e-5)
    np.testing.assert_allclose(split.state.theta, whole.state.theta, atol=1e-5)
    assert split.stats()["forwards_per_sample"] == whole.stats()["forwards_per_sample"] == 2


def test_the_parts_share_no_weight(tmp_path):
    files = split_files(SHIPPED[0], tmp_path)
    prefix, suffix = onnx.load(str(files.prefix)), onnx.load(str(files.suffix))
    shared = ({t.name for t in prefix.graph.initializer}
              & {t.name for t in suffix.graph.initializer})
    sizes = [int(np.prod(t.dims)) for t in suffix.graph.initializer if t.name in shared]
    assert max(sizes, default=0) <= 8  # scalar constants and shapes, no weight tensor
    assert split_files(SHIPPED[0], tmp_path) == files  # cached


def test_a_file_without_an_adapted_input_is_refused(tmp_path):
    model = onnx.load(str(SHIPPED[0]))
    theta = next(i for i in model.graph.input if i.name == "theta")
    model.graph.input.remove(theta)
    bad = tmp_path / "plain.onnx"
    onnx.save(model, str(bad))
    with pytest.raises(Exception, match="theta / prompt|cannot be split"):
        AdaptableSession(bad, provider="cpu", split=True)
