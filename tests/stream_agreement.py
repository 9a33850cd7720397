"""Statistical agreement of two adaptation paths that draw different random numbers (the
device step's Philox and float32 against the host step's PCG64 and float64): each adapts the
same noisy Fashion-MNIST stream under several seeds, and the seed means of accuracy and drift
are compared. One seed is not enough: on 2000 test images with the testbed's Gaussian noise of
sigma 0.2, two seeds of the same host path differed by 1.1 (ResNet-GN) and 1.4 (ViT) points and
12-24% of drift (docs/guide/gpu.md, "How CUDA agrees with the CPU"). The noise is drawn here
with NumPy (the testbed's corruption package is not on every GPU machine)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8

NOISE = 0.2  # Gaussian noise sigma, in [0, 1] pixel units
IMAGES = 2000
BATCH = 16


def noisy_stream(count: int = IMAGES) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` test images with Gaussian noise (uint8 [N, 32, 32, 3]) and labels."""
    images, labels = load_fashion_mnist("test")
    noise = np.random.default_rng(0).normal(0.0, 255.0 * NOISE, images[:count].shape)
    return np.clip(images[:count] + noise, 0, 255).astype(np.uint8), labels[:count]


def adapt_stream(policy: Policy, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Accuracy (%) of the served predictions and the final drift ||theta - theta0||."""
    x = preprocess_uint8(images, policy.metadata.preprocessing)
    correct = 0
    for start in range(0, len(labels), BATCH):
        served = policy.step(x[start:start + BATCH])
        correct += int((served.argmax(1) == labels[start:start + BATCH]).sum())
    return 100.0 * correct / len(labels), policy.model.drift()


def seed_means(load: Callable[[int], Policy], seeds: Sequence[int]) -> tuple[float, float]:
    """Mean accuracy and mean drift over ``seeds`` of the policy ``load(seed)`` gives."""
    images, labels = noisy_stream()
    runs = np.array([adapt_stream(load(seed), images, labels) for seed in seeds])
    return float(runs[:, 0].mean()), float(runs[:, 1].mean())
