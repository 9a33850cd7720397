"""Prometheus metrics of one server (its own registry, so several apps in a process don't mix)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..monitoring import Health
from .worker import StepRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _ExtensionGauges:
    """A collector over an extension's ``gauges()``, read at every scrape."""

    def __init__(self, gauges: Callable[[], list[tuple[str, str, float]]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, help_text, value in self._gauges():
            yield GaugeMetricFamily(name, help_text, value=value)


class _ModelFamilies:
    """A collector of the served model's families (:mod:`.model_series`), read from the model
    on the worker thread at a scrape and handed to :meth:`ServerMetrics.exposition`."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class ServerMetrics:
    """Requests by status, request latency (seconds), rows per step, adaptation steps, the
    largest batch; an extension's gauges (``extension_gauges``, read at every scrape) and the
    model's own series (handed to :meth:`exposition`)."""

    def __init__(
        self, max_batch: int,
        extension_gauges: Callable[[], list[tuple[str, str, float]]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        if extension_gauges is not None:
            self.registry.register(_ExtensionGauges(extension_gauges))
        self._model = _ModelFamilies()
        self.registry.register(self._model)
        self.requests = Counter(
            "eva0_requests", "Inference requests by HTTP status", ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "eva0_request_latency_seconds", "Inference request latency (seconds)",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        buckets = sorted({2**i for i in range(max_batch.bit_length() + 1)} | {max_batch})
        self.batch_rows = Histogram(
            "eva0_batch_rows", "Rows per adaptation step (after dynamic batching)",
            buckets=buckets, registry=self.registry,
        )
        self.batch_requests = Histogram(
            "eva0_batch_requests", "Requests coalesced into one adaptation step",
            buckets=buckets, registry=self.registry,
        )
        self.non_finite_rows = Counter(
            "eva0_non_finite_rows", "Rows of the model's output that were not finite",
            registry=self.registry,
        )
        self.steps = Counter(
            "eva0_adaptation_steps", "Adaptation steps run", registry=self.registry
        )
        self.skipped = Counter(
            "eva0_adaptation_skipped_steps", "Steps skipped (non-finite loss, gradient or theta)",
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "eva0_step_seconds", "Seconds in one adaptation step", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.drift = Gauge(
            "eva0_theta_drift", "||theta - theta0|| after the last step", registry=self.registry
        )
        self.guard_trips = Gauge(
            "eva0_guard_trips", "Health-guard trips (rollbacks) since the state began",
            registry=self.registry,
        )
        self.guard_audits = Gauge(
            "eva0_guard_audits", "Health-guard audits of theta against theta0 since the start",
            registry=self.registry,
        )
        self.guard_theta0_verdicts = Gauge(
            "eva0_guard_theta0_verdicts",
            "Guard duels (audits, pauses) that handed adaptation back to theta0 or held it there",
            registry=self.registry,
        )
        self.clipped = Gauge(
            "eva0_clipped_coefficients", "SPSA coefficients clipped since the state began",
            registry=self.registry,
        )
        self.adapting = Gauge(
            "eva0_adapting", "1 while adapting, 0 while frozen or paused by the guard",
            registry=self.registry,
        )
        self.max_batch_rows = Gauge(
            "eva0_max_batch_rows", "Most rows per adaptation step and per request (--max-batch)",
            registry=self.registry,
        )
        self.max_batch_rows.set(max_batch)

    def record_step(self, record: StepRecord, health: Health) -> None:
        """One step: its record and the model's health counters after it."""
        self.guard_trips.set(health.guard_trips)
        self.guard_audits.set(health.guard_audits)
        self.guard_theta0_verdicts.set(health.guard_theta0_verdicts)
        self.clipped.set(health.clipped_coefficients)
        self.adapting.set(1 if health.adapting else 0)
        self.steps.inc()
        if record.skipped:
            self.skipped.inc()
        self.batch_rows.observe(record.rows)
        self.batch_requests.observe(record.requests)
        self.step_seconds.observe(record.seconds)
        self.drift.set(health.drift)

    def exposition(self, model_families: list[Metric]) -> bytes:
        """The text exposition format, with ``model_families`` (:func:`.model_series.
        model_families`, read on the worker thread for this scrape)."""
        self._model.families = model_families
        return generate_latest(self.registry)
