"""The served model's own series in ``/metrics``: read from the model on the worker thread at
every scrape, between two batches, from the same numbers ``GET .../adaptation/statistics``
reports, so a scrape and the statistics route agree.

* ``eva0_samples_total``, ``eva0_forwards_total``: samples the model served and the forwards it
  ran for them (a forward: one theta row on one image), the counters of ``forwards_per_sample``;
* ``eva0_theta_updates_total``: adaptation steps taken on theta (the state's step counter);
* ``eva0_adaptation_state{state}``: 1 for the state the model is in
  (:data:`.series.GUARD_STATES`, as the dashboard's series reads it), 0 for the others;
* ``eva0_guard_signal{signal}``, ``eva0_guard_bound_min{signal}``,
  ``eva0_guard_bound_max{signal}``: the health guard's windowed signals (entropy / ln K, class
  spread / ln K, logit norm, drift ||theta - theta0||, alignment distance; all unitless) and
  where each trips; a signal not yet defined or a bound not checked has no series;
  ``eva0_guard_verdicts_total{verdict}``: the guard's pause verdicts (checkpoint, theta0, hold);
* ``eva0_budget_forwards_per_sample``, ``eva0_budget_credit_forwards``,
  ``eva0_budget_capacity_forwards``: the compute budget F, its credit and the bucket's size in
  extra forwards (only with a budget);
* ``eva0_stream_changes_total{detector}``: changes of stream seen in the input images
  (``inputs``, watched while the guard, the budget or the domain bank is on) and by the
  activation shift's detector (``activation_shift``);
* ``eva0_bank_hits_total``, ``eva0_bank_misses_total``, ``eva0_bank_evictions_total``,
  ``eva0_bank_slots_used``, ``eva0_bank_slots``: the domain bank (only with one).

Counts the model keeps in its state are counters here: a reset or a state put sets them back,
which Prometheus's ``rate`` and ``increase`` read as a counter reset.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..guard import SIGNALS, VERDICTS
from ..policy import Policy
from .series import GUARD_STATES, guard_state


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    """A counter family (``name`` without ``_total``: the exposition adds it)."""
    return CounterMetricFamily(name, help_text, value=value)


def _labelled(family: GaugeMetricFamily | CounterMetricFamily,
              values: dict[str, float | None]) -> GaugeMetricFamily | CounterMetricFamily:
    """``family`` with one sample per label value whose value is not None."""
    for label, value in values.items():
        if value is not None:
            family.add_metric([label], value)
    return family


def _guard_families(guard_stats: dict[str, Any]) -> list[Metric]:
    bounds = guard_stats["bounds"]
    return [
        _labelled(GaugeMetricFamily(
            "eva0_guard_signal", "Health-guard signal, windowed (entropy and spread / ln K, "
            "logit norm, drift ||theta - theta0||, alignment distance)", labels=["signal"]),
            guard_stats["signals"]),
        _labelled(GaugeMetricFamily(
            "eva0_guard_bound_min", "Health-guard bound: the signal trips below it",
            labels=["signal"]), {s: bounds.get(f"{s}_min") for s in SIGNALS}),
        _labelled(GaugeMetricFamily(
            "eva0_guard_bound_max", "Health-guard bound: the signal trips above it",
            labels=["signal"]), {s: bounds.get(f"{s}_max") for s in SIGNALS}),
        _labelled(CounterMetricFamily(
            "eva0_guard_verdicts", "Health-guard pause and audit verdicts (where adaptation "
            "went on: the candidate, theta0, or a hold at theta0)", labels=["verdict"]),
            {v: guard_stats["pause_verdicts"][v] for v in VERDICTS}),
    ]


def _budget_families(policy: Policy) -> list[Metric]:
    budget = policy.budget
    if budget is None:
        return []
    return [
        GaugeMetricFamily("eva0_budget_forwards_per_sample",
                          "Compute budget F (forwards per sample)", value=budget.budget),
        GaugeMetricFamily("eva0_budget_credit_forwards", "Compute budget credit (extra "
                          "forwards; below 0 while a guard duel is paid for)",
                          value=budget.credit),
        GaugeMetricFamily("eva0_budget_capacity_forwards",
                          "Compute budget bucket size, (F - 1) x burst (extra forwards)",
                          value=budget.capacity),
    ]


def _bank_families(bank_stats: dict[str, Any] | None) -> list[Metric]:
    if bank_stats is None:
        return []
    return [
        _counter("eva0_bank_hits", "Domain-bank recalls that restored a stored stream's state",
                 bank_stats["hits"]),
        _counter("eva0_bank_misses", "Domain-bank look-ups that found no stored stream",
                 bank_stats["misses"]),
        _counter("eva0_bank_evictions", "Domain-bank memories evicted for a new one",
                 bank_stats["evictions"]),
        GaugeMetricFamily("eva0_bank_slots_used", "Domain-bank slots holding a memory",
                          value=bank_stats["used"]),
        GaugeMetricFamily("eva0_bank_slots", "Domain-bank slots", value=bank_stats["slots"]),
    ]


def model_families(policy: Policy) -> list[Metric]:
    """The series above, read from ``policy`` (call on the worker thread, between steps)."""
    stats = policy.stats()
    state = guard_state(policy)
    shift = stats.get("activation_shift")
    families: list[Metric] = [
        _counter("eva0_samples", "Samples the model served", stats["samples"]),
        _counter("eva0_forwards", "Forwards the model ran (one theta row on one image)",
                 stats["forwards"]),
        _counter("eva0_theta_updates", "Adaptation steps taken on theta (the state's step "
                 "counter, skipped steps included)", stats["steps"]),
        _labelled(GaugeMetricFamily(
            "eva0_adaptation_state", "1 for the adaptation's state (adapting, frozen, paused, "
            "dueling, holding, off), 0 for the others", labels=["state"]),
            {s: float(s == state) for s in GUARD_STATES}),
        _labelled(CounterMetricFamily(
            "eva0_stream_changes", "Changes of stream seen in the input images (inputs) and by "
            "the activation shift's detector (activation_shift)", labels=["detector"]),
            {"inputs": policy.inputs.changes,
             "activation_shift": None if shift is None else shift["stream_changes"]}),
    ]
    if stats.get("guard") is not None:
        families += _guard_families(stats["guard"])
    return families + _budget_families(policy) + _bank_families(stats["bank"])
