"""The paper's evaluation protocols over a list of corrupted domains.

* ``single``: each corruption is its own stream; the method is reset before each.
* ``continual``: the corruptions in sequence as one stream, never reset.
* ``imbalanced``: SAR's online label shift: each corruption's stream sorted by class (imbalance
  ratio infinite), reset per corruption.
* ``soak``: the continual stream ``SOAK_PASSES`` (10) times in a row, never reset; domains are
  reported per pass as ``<domain>@<pass>``.

Streams are a seeded shuffle of each domain (``single`` / ``continual``), as TTA code bases load
ImageNet-C with ``shuffle=True``; an ``ordered`` domain (a hostile stream) keeps its order.
Unlabelled samples (label -1) are streamed but not scored; a domain with none scored has
accuracy NaN, left out of the average.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.progress import progress_bar

from .datasets import Domain

PROTOCOLS = ("single", "continual", "imbalanced", "soak")
SOAK_PASSES = 10


class StreamMethod(Protocol):
    def step(self, x: np.ndarray) -> np.ndarray: ...

    def reset(self) -> None: ...


@dataclass
class StreamResult:
    """Accuracy (%) per domain, and per-batch traces along the whole stream."""

    method: str
    accuracy: dict[str, float]
    batch: int = 0
    batch_correct: list[int] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=list)
    batch_domain: list[str] = field(default_factory=list)
    drift: list[float] = field(default_factory=list)
    logit_norm: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    forwards_per_sample: float | None = None
    final_stats: dict = field(default_factory=dict)

    @property
    def average(self) -> float:
        """Mean accuracy over the scored domains (NaN domains left out)."""
        values = [v for v in self.accuracy.values() if np.isfinite(v)]
        return float(np.mean(values)) if values else float("nan")


def stream_order(domain: Domain, protocol: str, seed: int) -> np.ndarray:
    """Indices of the domain in stream order for ``protocol``."""
    if domain.ordered:
        return np.arange(len(domain))
    rng = np.random.default_rng([seed, len(domain)])
    order = rng.permutation(len(domain))
    if protocol == "imbalanced":
        order = order[np.argsort(domain.labels[order], kind="stable")]
    return order


def drift_of(method) -> float:
    """The method's ||theta - theta0|| now: from its health counters (runtime methods), its
    statistics (torch baselines), or NaN."""
    health = getattr(method, "health", None)
    if health is not None:
        return float(health().drift)
    stats = getattr(method, "stats", None)
    return float(stats()["drift"]) if stats else float("nan")


def run_protocol(
    name: str,
    make_method: Callable[[], StreamMethod],
    domains: Sequence[Domain],
    protocol: str,
    batch_size: int,
    pre: Preprocessing,
    seed: int = 0,
    progress: bool = True,
) -> StreamResult:
    """Stream every domain through a fresh method (reset as the protocol says)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    method = make_method()
    result = StreamResult(name, {}, batch_size)
    passes = SOAK_PASSES if protocol == "soak" else 1
    schedule = [(d, p) for p in range(1, passes + 1) for d in domains]
    total = sum(-(-len(d) // batch_size) for d, _ in schedule)
    bar = progress_bar(total=total, desc=f"{name} [{protocol}]", unit="batch",
                       quiet=not progress, leave=False)
    for i, (domain, pass_index) in enumerate(schedule):
        if i > 0 and protocol in ("single", "imbalanced"):
            method.reset()
        correct = seen = 0
        stream = domain.subset(stream_order(domain, protocol, seed))
        for x, y in stream.batches(batch_size, pre):
            logits = method.step(x)
            hits = int((logits.argmax(axis=1) == y).sum())  # label -1 never hits
            correct += hits
            result.batch_correct.append(hits)
            result.batch_size.append(len(y))
            result.batch_domain.append(domain.name)
            result.logit_norm.append(float(np.linalg.norm(logits, axis=1).mean()))
            result.drift.append(drift_of(method))
            bar.update(1)
            seen += len(y)
            bar.set_postfix(domain=domain.name, acc=f"{100.0 * correct / seen:.1f}")
        scored = int((domain.labels >= 0).sum())
        key = f"{domain.name}@{pass_index}" if passes > 1 else domain.name
        result.accuracy[key] = 100.0 * correct / scored if scored else float("nan")
    bar.close()
    stats = getattr(method, "stats", None)
    if stats:
        final = stats()
        result.final_stats = final
        result.skipped_steps = int(final["skipped_steps"])
        result.forwards_per_sample = float(final["forwards_per_sample"])
    return result
