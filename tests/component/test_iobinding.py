"""IOBinding gives the same numbers as plain ``session.run``, reuses its output buffers, and
never lets a later call overwrite what a step returned."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import SHIPPED, uniform_batch


@pytest.mark.parametrize("budget", [None, 0.5])  # the copies in one suffix call, or in two
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_split_sessions_through_io_binding_equal_one_plain_call(path, budget):
    """Split sessions bound (the CUDA default) give the one-file numbers; the prefix's
    activations reach the suffix as OrtValues (on CUDA: never copied to the host)."""
    plain = AdaptableSession(path, provider="cpu", split=False)
    bound = AdaptableSession(path, provider="cpu", split=True, io_binding=True,
                             memory_budget_mb=budget)
    prefix, _ = bound.parts.binders
    handed = []
    run = prefix.run

    def spy(*args, **kwargs):
        values = run(*args, **kwargs)
        handed.extend(values)
        return values

    prefix.run = spy
    x = bound.check_input(uniform_batch(4, seed=2, size=plain.metadata.preprocessing.input_size))
    noise = np.random.default_rng(0).normal(0, 0.1, (8, plain.metadata.num_params))
    theta = (plain.metadata.theta0 + noise).astype(np.float32)
    for expected, got in zip(plain.run(x, theta), bound.run(x, theta), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert handed and all(isinstance(v, ort.OrtValue) for v in handed)
    assert bound.io_binding and plain.io_binding is False
