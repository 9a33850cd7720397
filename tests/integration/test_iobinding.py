"""IOBinding gives the same numbers as plain ``session.run``, reuses its output buffers, and
never lets a later call overwrite what a step returned."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import uniform_batch


@pytest.mark.parametrize("method", ["eva0", "zoa"])
def test_bound_steps_equal_plain_steps(small_model, method):
    plain = Policy.load(small_model.onnx_path, method, seed=3, provider="cpu")
    bound = Policy.load(small_model.onnx_path, method, seed=3, provider="cpu", io_binding=True)
    lean = Policy.load(small_model.onnx_path, method, seed=3, provider="cpu", io_binding=True,
                       low_memory=True)
    for i, batch in enumerate((1, 4, 4, 2)):
        x = uniform_batch(batch, seed=i)
        expected = plain.step(x)
        np.testing.assert_array_equal(bound.step(x), expected)
        np.testing.assert_array_equal(lean.step(x), expected)
    np.testing.assert_array_equal(bound.state.theta, plain.state.theta)
    np.testing.assert_array_equal(lean.state.theta, plain.state.theta)


def test_returned_logits_survive_later_calls(small_vit):
    model = Policy.load(small_vit.onnx_path, "zoa", seed=0, provider="cpu", io_binding=True)
    x, y = uniform_batch(2, seed=0), uniform_batch(2, seed=1)
    first_step = model.step(x)
    kept_step = first_step.copy()
    first_pred = model.predict(x)
    kept_pred = first_pred.copy()
    model.step(y)
    model.predict(y)
    np.testing.assert_array_equal(first_step, kept_step)
    np.testing.assert_array_equal(first_pred, kept_pred)


def test_outputs_are_written_into_reused_buffers(small_vit):
    from eva0_edge.runtime.modelfile import read_metadata

    metadata = read_metadata(small_vit.onnx_path)
    session = AdaptableSession(small_vit.onnx_path, metadata, "cpu", io_binding=True)
    theta = np.tile(metadata.theta0.astype(np.float32), (4, 1))
    x = session.check_input(uniform_batch(2, seed=0))
    logits_a, features_a = session.run(x, theta)
    logits_a = logits_a.copy()
    logits_b, features_b = session.run(session.check_input(uniform_batch(2, seed=1)), theta)
    assert np.shares_memory(features_a, features_b)  # same buffer, new numbers
    assert not np.array_equal(logits_a, logits_b)
    plain = AdaptableSession(small_vit.onnx_path, metadata, "cpu")
    np.testing.assert_array_equal(logits_b, plain.run(session.check_input(
        uniform_batch(2, seed=1)), theta)[0])


def test_foa_through_io_binding_equals_plain(prompt_vit):
    plain = Policy.load(prompt_vit.onnx_path, "foa", seed=0, provider="cpu")
    bound = Policy.load(prompt_vit.onnx_path, "foa", seed=0, provider="cpu", io_binding=True)
    for i in range(2):
        x = uniform_batch(2, seed=i)
        np.testing.assert_array_equal(bound.step(x), plain.step(x))


def test_bench_times_io_binding_modes(small_vit):
    from eva0_edge.bench import cost

    assert cost.session_mode("eva0-lowmem-iob") == (
        "eva0", {"low_memory": True, "io_binding": True, "split": None}
    )
    report = cost.run_bench(str(small_vit.onnx_path), [2], ["eva0-iob", "noadapt-iob"],
                            repeats=1, warmup=1, threads=1, memory=False, progress=False)
    assert [r["method"] for r in report["rows"]] == ["noadapt", "eva0-iob", "noadapt-iob"]
    assert report["provider"] == "cpu"
