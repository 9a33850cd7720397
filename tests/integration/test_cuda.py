"""The CUDA provider gives the CPU's numbers (skipped without onnxruntime-gpu and a GPU).

Run where a GPU is: ``pytest tests/integration/test_cuda.py`` (``bench/gpu_check.sh``
does, with the cost tables). The CUDA provider computes convolutions and matrix products with
TF32 by default, hence the tolerances."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import SHIPPED_RESNET_GN, SHIPPED_VIT

pytestmark = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs onnxruntime-gpu",
)

SHIPPED = [SHIPPED_RESNET_GN, SHIPPED_VIT]


def _batch(metadata, n: int, seed: int) -> np.ndarray:
    pre = metadata.preprocessing
    x = np.random.default_rng(seed).uniform(0, 1, (n, *pre.input_size)).astype(np.float32)
    mean = np.asarray(pre.mean, np.float32)[:, None, None]
    std = np.asarray(pre.std, np.float32)[:, None, None]
    return (x - mean) / std


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("io_binding", [False, True])
def test_cuda_forward_matches_cpu(path, io_binding):
    metadata = read_metadata(path)
    cpu = AdaptableSession(path, metadata, "cpu")
    cuda = AdaptableSession(path, metadata, "cuda", io_binding=io_binding)
    assert cuda.session.get_providers()[0] == "CUDAExecutionProvider"
    x = cpu.check_input(_batch(metadata, 8, 0))
    theta = np.tile(metadata.theta0.astype(np.float32), (16, 1))
    for want, got in zip(cpu.run(x, theta), cuda.run(x, theta), strict=True):
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, atol=2e-3 * scale, rtol=0)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("mode", [{}, {"split": False}], ids=["default", "one-call"])
def test_cuda_adaptation_follows_cpu(path, mode):
    """Ten EVA-0 steps: the same predictions up to rounding, theta within 5% of its drift.
    The CUDA default: split sessions through IOBinding, the perturbations drawn ahead.
    (Random images would trip the health guard, which then rolls both back: it is off.)"""
    config = {"guard": False}
    cpu = Policy.load(path, "eva0", config, seed=0, provider="cpu")
    cuda = Policy.load(path, "eva0", config, seed=0, provider="cuda", **mode)
    assert cuda.session.io_binding and cuda.model.estimator.prefetch is not None
    assert (cuda.session.parts is not None) == ("split" not in mode)
    agree = total = 0
    for i in range(10):
        x = _batch(cpu.metadata, 16, i)
        agree += int((cpu.step(x).argmax(1) == cuda.step(x).argmax(1)).sum())
        total += 16
    assert agree >= 0.97 * total
    drift = np.linalg.norm(cpu.state.theta - cpu.metadata.theta0)
    assert drift > 0
    gap = np.linalg.norm(cuda.state.theta - cpu.state.theta)
    print(f"{path.stem}: drift {drift:.4g}, CUDA - CPU {gap:.4g}, argmax agreement {agree}/{total}")
    assert gap <= 0.05 * drift


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_cuda_budget_follows_cpu(path):
    """The compute budget on CUDA (default mode, perturbations drawn ahead): in the settled
    schedule at budget 1.5 (dense again after a change of stream: random batches are one);
    the same batches adapted on as on the CPU (the forward counters agree), the same
    predictions up to rounding."""
    config = {"guard": False, "budget": 1.5}
    models = [Policy.load(path, "eva0", config, seed=0, provider=p) for p in ("cpu", "cuda")]
    for model in models:
        model.budget.dense = False  # a stream already learnt: adapt whenever the bucket is full
    agree = total = 0
    for i in range(12):
        x = _batch(models[0].metadata, 16, i)
        cpu_pred, cuda_pred = (model.step(x).argmax(1) for model in models)
        agree += int((cpu_pred == cuda_pred).sum())
        total += 16
    cpu, cuda = models
    assert cuda.session.counter.forwards == cpu.session.counter.forwards
    assert 1.0 < cpu.session.counter.per_sample < 2.0  # some batches served, some adapted on
    assert agree >= 0.97 * total
    drift = np.linalg.norm(cpu.state.theta - cpu.metadata.theta0)
    assert drift > 0
    assert np.linalg.norm(cuda.state.theta - cpu.state.theta) <= 0.05 * drift
