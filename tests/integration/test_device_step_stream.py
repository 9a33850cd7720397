"""The device step's algorithm (its Philox perturbations, its float32 gradient), run over NumPy on
the CPU, adapts a noisy stream as the host step does: over four seeds each, the mean accuracy
within 1 point and the mean drift within 15% (the per-seed spread: tests/stream_agreement.py).
On a GPU, tests/integration/test_cuda.py compares CUDA's device step with the CPU the same
way."""

from __future__ import annotations

import numpy as np

from eva0_edge.runtime.device_step import DeviceEstimator
from eva0_edge.runtime.policy import Policy
from tests.fixtures import SHIPPED_RESNET_GN
from tests.stream_agreement import seed_means

SEEDS = (0, 1, 2, 3)


def _host(seed: int) -> Policy:
    return Policy.load(SHIPPED_RESNET_GN, "eva0", {}, seed=seed, provider="cpu")


def _device_algorithm(seed: int) -> Policy:
    policy = _host(seed)
    engine = policy.model
    engine.estimator = DeviceEstimator(engine.session, engine.config, engine.estimator.objective,
                                       np)
    return policy


def test_the_device_steps_algorithm_adapts_a_noisy_stream_as_the_host_step():
    host_accuracy, host_drift = seed_means(_host, SEEDS)
    device_accuracy, device_drift = seed_means(_device_algorithm, SEEDS)
    print(f"host {host_accuracy:.2f} % drift {host_drift:.3f}; "
          f"device algorithm {device_accuracy:.2f} % drift {device_drift:.3f}")
    assert abs(device_accuracy - host_accuracy) <= 1.0
    assert abs(device_drift / host_drift - 1.0) <= 0.15
