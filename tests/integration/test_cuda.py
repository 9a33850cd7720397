"""The CUDA provider gives the CPU's numbers (skipped without onnxruntime-gpu and a GPU).

Run where a GPU is: ``pytest tests/integration/test_cuda.py`` (``bench/gpu_check.sh``
does, with the cost tables). The CUDA provider computes convolutions and matrix products with
TF32 by default, hence the tolerances. The host step on CUDA (``device_step=False``) follows
the CPU's numbers; the default device step (:mod:`~eva0_edge.runtime.device_step`) draws its
own (Philox, float32 losses) and agrees statistically: seed means over a noisy stream
(tests/stream_agreement.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from eva0_edge.runtime.counter_rng import NORMAL, UNIFORM, device_rows, draw_rows
from eva0_edge.runtime.inputwatch import describe
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import DEVICE_BATCH_VALUES, AdaptableSession, InputError
from tests.fixtures import SHIPPED_RESNET_GN, SHIPPED_VIT
from tests.stream_agreement import seed_means

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


def test_philox_kernel_equals_its_numpy_reference():
    for stream in (NORMAL, UNIFORM):
        for rows, width, first in ((64, 53_001, 0), (3, 7, 5)):
            want = draw_rows(7, 2**40 + 3, stream, rows, width, first)
            got = device_rows(7, 2**40 + 3, stream, rows, width, first).get()
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_device_step_serves_and_describes_the_cpus_numbers(path):
    """A batch of DEVICE_BATCH_VALUES values or more stays resident: a served call (one theta
    broadcast on the device) gives the CPU's logits, the input descriptors computed there the
    host's. A smaller batch is checked and served from the host."""
    metadata = read_metadata(path)
    cpu = AdaptableSession(path, metadata, "cpu")
    cuda = AdaptableSession(path, metadata, "cuda")
    assert cuda.device_step
    small = cuda.check_input(_batch(metadata, 8, 1))
    assert cuda.resident(small) is None
    rows = -(-DEVICE_BATCH_VALUES // int(np.prod(metadata.preprocessing.input_size)))
    x = cuda.check_input(_batch(metadata, rows, 0))
    assert cuda.resident(x) is not None and cuda.resident(x.copy()) is None
    theta = np.broadcast_to(metadata.theta0.astype(np.float32), (rows, metadata.num_params))
    for want, got in zip(cpu.run(x, theta), cuda.run(x, theta), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-3 * float(np.abs(want).max()), rtol=0)
    np.testing.assert_allclose(describe(cuda.resident(x)), describe(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="range"):
        cuda.check_input(np.full_like(x, 1e6))
    poisoned = x.copy()
    poisoned[3, 0, 5, 7] = np.nan
    with pytest.raises(InputError, match="NaN"):
        cuda.check_input(poisoned)
    assert cuda.resident(x) is not None  # a refused batch leaves the last one resident


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_device_step_adapts_a_noisy_stream_as_the_cpu(path):
    """Seed means over 2000 noisy test images (four seeds): ResNet-GN within 1 point and 15%
    of drift, the ViT (twice the seed spread) within 2 points and 25%."""
    seeds = (0, 1, 2, 3)
    cpu = seed_means(lambda seed: Policy.load(path, "eva0", {}, seed=seed, provider="cpu"),
                     seeds)
    cuda = seed_means(lambda seed: Policy.load(path, "eva0", {}, seed=seed, provider="cuda"),
                      seeds)
    print(f"{path.stem}: CPU {cpu[0]:.2f} % drift {cpu[1]:.3f}; CUDA device step "
          f"{cuda[0]:.2f} % drift {cuda[1]:.3f}")
    points, share = (1.0, 0.15) if path == SHIPPED_RESNET_GN else (2.0, 0.25)
    assert abs(cuda[0] - cpu[0]) <= points
    assert abs(cuda[1] / cpu[1] - 1.0) <= share


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("mode", [{}, {"split": False}], ids=["default", "one-call"])
def test_cuda_host_step_follows_cpu(path, mode):
    """Ten EVA-0 steps of the host step on CUDA: the same predictions up to rounding, theta
    within 5% of its drift. Split sessions through IOBinding, the perturbations drawn ahead.
    (Random images would trip the health guard, which then rolls both back: it is off.)"""
    config = {"guard": False}
    cpu = Policy.load(path, "eva0", config, seed=0, provider="cpu")
    cuda = Policy.load(path, "eva0", config, seed=0, provider="cuda", device_step=False, **mode)
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
    models = [Policy.load(path, "eva0", config, seed=0, provider=p, device_step=False)
              for p in ("cpu", "cuda")]
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


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_cuda_device_step_keeps_the_cpus_budget_schedule(path):
    """The device step under a budget of 1.5 adapts on about as many batches as the CPU (its
    input descriptors are computed on the device): the forward counters within two batches of
    16 (the schedule also reads the stream's features, which follow theta; on an H200 the ViT
    adapted on one batch fewer than the CPU, the ResNet-GN on the same ones)."""
    config = {"guard": False, "budget": 1.5}
    models = [Policy.load(path, "eva0", config, seed=0, provider=p) for p in ("cpu", "cuda")]
    assert models[1].session.device_step
    for model in models:
        model.budget.dense = False
    for i in range(12):
        for model in models:
            model.step(_batch(models[0].metadata, 16, i))
    cpu, cuda = models
    assert abs(cuda.session.counter.forwards - cpu.session.counter.forwards) <= 2 * 16
    assert 1.0 < cuda.session.counter.per_sample < 2.0
