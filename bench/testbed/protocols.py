"""The paper's evaluation protocols over a list of corrupted domains.

* ``single``: each corruption is its own stream; the method is reset before each.
* ``continual``: the corruptions in sequence as one stream, never reset.
* ``imbalanced``: SAR's online label shift: each corruption's stream sorted by class (imbalance
  ratio infinite), reset per corruption.
* ``soak``: the continual stream ``soak_passes`` (default :data:`SOAK_PASSES`, 10) times in a
  row, never reset; domains are reported per pass as ``<domain>@<pass>``.
* ``gradual``: CoTTA's gradual protocol: for each corruption in turn its severity rises
  1 -> 5 and falls back to 1 (:data:`GRADUAL_SEVERITIES`), one stream never reset; each step
  streams the corruption's images at that severity in a fresh seeded shuffle. The domains
  given hold every corruption at every severity 1-5; accuracy is per corruption, all its steps
  together (the steps' own in :attr:`StreamResult.steps`).
* ``mixed``: SAR's mixed-domain setting: every domain's images pooled and shuffled into one
  stream (each batch drawn from several domains), never reset; each sample is scored against
  its own domain, so accuracy is still per domain.

Streams are a seeded shuffle of each domain (``single`` / ``continual``), as TTA code bases load
ImageNet-C with ``shuffle=True``; an ``ordered`` domain (a hostile stream) keeps its order
(pooled into ``mixed``, it is shuffled with the rest).
Unlabelled samples (label -1) are streamed but not scored; a domain with none scored has
accuracy NaN, left out of the average.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.progress import progress_bar

if TYPE_CHECKING:  # the CLI reads PROTOCOLS without the testbed's image libraries
    from .datasets import Domain

PROTOCOLS = ("single", "continual", "imbalanced", "soak", "gradual", "mixed")
RESETTING = ("single", "imbalanced")  # the protocols that reset the method per domain
SOAK_PASSES = 10
GRADUAL_SEVERITIES = (1, 2, 3, 4, 5, 4, 3, 2, 1)  # the steps within one corruption
SEVERITIES = (1, 2, 3, 4, 5)
MIXED = "mixed"  # the per-batch domain name of a mixed stream


class StreamMethod(Protocol):
    def step(self, x: np.ndarray) -> np.ndarray: ...

    def reset(self) -> None: ...


@dataclass
class StreamResult:
    """Accuracy (%) per domain, and per-batch traces along the whole stream; ``severity``: the
    corruption severity of the stream (None: several, as ``gradual``'s); ``steps``: the
    accuracy of each of ``gradual``'s steps, in stream order (empty for the others)."""

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
    severity: int | None = None
    steps: list[dict] = field(default_factory=list)

    @property
    def average(self) -> float:
        """Mean accuracy over the scored domains (NaN domains left out)."""
        values = [v for v in self.accuracy.values() if np.isfinite(v)]
        return float(np.mean(values)) if values else float("nan")


@dataclass
class Segment:
    """One stretch of a protocol's stream: ``domain``'s samples in ``order`` (indices [n]),
    sample i scored under ``keys[i]`` (str [n], in stream order) of ``names`` (the keys it
    scores, in report order); the method is reset before it when ``reset``; ``afresh``: its
    keys' counts start over (a domain streamed twice reports its last visit), else they add up
    (``gradual``'s steps of one corruption); ``label`` names its batches in the traces."""

    domain: Domain
    order: np.ndarray
    keys: np.ndarray
    names: list[str]
    label: str
    reset: bool = False
    afresh: bool = True


def stream_order(domain: Domain, protocol: str, seed: int) -> np.ndarray:
    """Indices of the domain in stream order for ``protocol``."""
    if domain.ordered:
        return np.arange(len(domain))
    rng = np.random.default_rng([seed, len(domain)])
    order = rng.permutation(len(domain))
    if protocol == "imbalanced":
        order = order[np.argsort(domain.labels[order], kind="stable")]
    return order


def gradual_order(domain: Domain, seed: int, step: int) -> np.ndarray:
    """Indices of the domain in stream order at step ``step`` (0-8) of ``gradual``: a shuffle
    of its own per step (an ``ordered`` domain keeps its order)."""
    if domain.ordered:
        return np.arange(len(domain))
    return np.random.default_rng([seed, len(domain), step]).permutation(len(domain))


def _whole(domain: Domain, order: np.ndarray, key: str, reset: bool = False,
           afresh: bool = True) -> Segment:
    """A segment of one domain, every sample scored under ``key``."""
    return Segment(domain, order, np.full(len(order), key, dtype=object), [key], domain.name,
                   reset, afresh)


def gradual_segments(domains: Sequence[Domain], seed: int) -> list[Segment]:
    """``gradual``'s steps: each corruption (in the order given) at each of
    :data:`GRADUAL_SEVERITIES`; ValueError when a corruption lacks one of its severities."""
    by_level = {(d.name, d.severity): d for d in domains}
    segments = []
    for name in dict.fromkeys(d.name for d in domains):
        missing = [s for s in SEVERITIES if (name, s) not in by_level]
        if missing:
            raise ValueError(f"gradual streams every severity 1-5 of each corruption; {name} "
                             f"has none at severity {missing}")
        for step, severity in enumerate(GRADUAL_SEVERITIES):
            domain = by_level[name, severity]
            segments.append(_whole(domain, gradual_order(domain, seed, step), name,
                                   afresh=step == 0))
    return segments


def mixed_segment(domains: Sequence[Domain], seed: int) -> Segment:
    """``mixed``'s one stream: every domain's samples pooled and shuffled, each scored under its
    own domain's name."""
    from .datasets import pooled

    pool = pooled(domains, MIXED)
    keys = np.repeat(np.array([d.name for d in domains], dtype=object),
                     [len(d) for d in domains])
    order = np.random.default_rng([seed, len(pool)]).permutation(len(pool))
    return Segment(pool, order, keys[order], list(dict.fromkeys(d.name for d in domains)),
                   MIXED)


def schedule(
    domains: Sequence[Domain], protocol: str, seed: int, soak_passes: int = SOAK_PASSES
) -> list[Segment]:
    """The segments of ``protocol``'s stream over ``domains``, in stream order."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    if protocol == "gradual":
        return gradual_segments(domains, seed)
    if protocol == "mixed":
        return [mixed_segment(domains, seed)]
    if protocol == "soak":
        return [_whole(d, stream_order(d, protocol, seed), f"{d.name}@{p}")
                for p in range(1, soak_passes + 1) for d in domains]
    return [_whole(d, stream_order(d, protocol, seed), d.name, i > 0 and protocol in RESETTING)
            for i, d in enumerate(domains)]


def stream_batches(segments: Sequence[Segment], batch_size: int) -> int:
    """The batches a run over ``segments`` streams (no batch spans two segments)."""
    return sum(-(-len(s.order) // batch_size) for s in segments)


def drift_of(method) -> float:
    """The method's ||theta - theta0|| now: from its health counters (runtime methods), its
    statistics (torch baselines), or NaN."""
    health = getattr(method, "health", None)
    if health is not None:
        return float(health().drift)
    stats = getattr(method, "stats", None)
    return float(stats()["drift"]) if stats else float("nan")


def _tally(keys: np.ndarray, hits: np.ndarray, totals: dict[str, int]) -> None:
    """Add the hits (bool [b]) of samples scored under ``keys`` (str [b]) to ``totals``."""
    for key in dict.fromkeys(keys):
        totals[key] += int(hits[keys == key].sum())


def _percent(hits: int, scored: int) -> float:
    return 100.0 * hits / scored if scored else float("nan")


def run_protocol(
    name: str,
    make_method: Callable[[], StreamMethod],
    domains: Sequence[Domain],
    protocol: str,
    batch_size: int,
    pre: Preprocessing,
    seed: int = 0,
    progress: bool = True,
    soak_passes: int = SOAK_PASSES,
) -> StreamResult:
    """Stream every domain through a fresh method (reset as the protocol says); ``soak``
    streams them ``soak_passes`` times."""
    segments = schedule(domains, protocol, seed, soak_passes)
    method = make_method()
    result = StreamResult(name, {}, batch_size)
    keys = dict.fromkeys(k for s in segments for k in s.names)
    correct, scored = dict.fromkeys(keys, 0), dict.fromkeys(keys, 0)
    bar = progress_bar(total=stream_batches(segments, batch_size), desc=f"{name} [{protocol}]",
                       unit="batch", quiet=not progress, leave=False)
    for segment in segments:
        if segment.reset:
            method.reset()
        if segment.afresh:
            correct.update(dict.fromkeys(segment.names, 0))
            scored.update(dict.fromkeys(segment.names, 0))
        stream = segment.domain.subset(segment.order)
        _tally(segment.keys, stream.labels >= 0, scored)
        hits_here = seen = 0
        for x, y in stream.batches(batch_size, pre):
            logits = method.step(x)
            hits = logits.argmax(axis=1) == y  # label -1 never hits
            _tally(segment.keys[seen:seen + len(y)], hits, correct)
            hits_here += int(hits.sum())
            seen += len(y)
            result.batch_correct.append(int(hits.sum()))
            result.batch_size.append(len(y))
            result.batch_domain.append(segment.label)
            result.logit_norm.append(float(np.linalg.norm(logits, axis=1).mean()))
            result.drift.append(drift_of(method))
            bar.update(1)
            bar.set_postfix(domain=segment.label, acc=f"{100.0 * hits_here / seen:.1f}")
        if protocol == "gradual":
            result.steps.append({"domain": segment.label, "severity": segment.domain.severity,
                                 "accuracy": _percent(hits_here, int((stream.labels >= 0).sum()))})
    bar.close()
    result.accuracy = {k: _percent(correct[k], scored[k]) for k in keys}
    stats = getattr(method, "stats", None)
    if stats:
        final = stats()
        result.final_stats = final
        result.skipped_steps = int(final["skipped_steps"])
        result.forwards_per_sample = float(final["forwards_per_sample"])
    return result
