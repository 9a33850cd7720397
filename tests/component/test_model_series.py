"""The served model's own series in ``/metrics`` (:mod:`eva0_edge.runtime.server.model_series`):
the adaptation state through each of its values, every number against the statistics the
model reports, and the route that reads them on the worker thread."""

from __future__ import annotations

import json

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server.app import ServeOptions, create_app
from eva0_edge.runtime.server.metrics import ServerMetrics
from eva0_edge.runtime.server.model_series import model_families
from eva0_edge.runtime.server.series import GUARD_STATES
from tests.fixtures import SHIPPED_RESNET_GN, InProcessServer, http_call, uniform_batch

MODEL = SHIPPED_RESNET_GN


def _load(method: str = "eva0", **config) -> Policy:
    return Policy.load(MODEL, method, config, provider="cpu", threads=1)


def _samples(policy: Policy) -> dict[tuple[str, tuple], float]:
    """Every sample of the model's series, by (sample name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in model_families(policy) for s in family.samples}


def _state(policy: Policy) -> str:
    """The one state ``eva0_adaptation_state`` marks (it must mark exactly one)."""
    values = _samples(policy)
    marked = [s for s in GUARD_STATES if values[("eva0_adaptation_state", (("state", s),))] == 1.0]
    assert len(marked) == 1 and sum(
        values[("eva0_adaptation_state", (("state", s),))] for s in GUARD_STATES) == 1.0
    return marked[0]


def _walk(policy: Policy, x: np.ndarray) -> list[str]:
    """The state after each batch of 16 rows of x."""
    seen = []
    for i in range(0, len(x), 16):
        policy.step(x[i : i + 16])
        seen.append(_state(policy))
    return seen


def test_an_audit_on_noise_duels_then_holds():
    """Uniform noise: an audit after 32 adapted samples duels the adapted theta against theta0,
    theta0's own signals are out of bounds on noise, so the guard holds at theta0."""
    model = _load(guard_audit=32)
    assert _state(model) == "adapting"
    seen = _walk(model, uniform_batch(320, seed=1))
    assert seen[0] == "adapting" and "dueling" in seen and seen[-1] == "holding"
    assert seen.index("dueling") < seen.index("holding")
    assert set(seen) == {"adapting", "dueling", "holding"}
    assert model.stats()["guard"]["pause_verdicts"]["hold"] >= 1


def test_a_trip_with_no_checkpoint_pauses_at_theta0():
    """A drift bound of 1e-6 trips on the first check; the rollback goes to theta0 (no healthy
    checkpoint yet), so the pause runs theta0 alone: paused, not dueling."""
    model = _load(guard_drift_max=1e-6)
    seen = _walk(model, uniform_batch(128, seed=2))
    assert model.stats()["guard"]["trips"] == 1
    assert seen[:3] == ["adapting"] * 3 and seen[3:] == ["paused"] * (len(seen) - 3)


def test_frozen_and_methods_that_never_adapt():
    x = uniform_batch(16)
    frozen = _load()
    frozen.freeze(True)
    frozen.step(x)
    assert _state(frozen) == "frozen"
    for model in (_load("noadapt"), _load(budget=1)):
        model.step(x)
        assert _state(model) == "off"
    frozen.freeze(False)
    frozen.step(x)
    assert _state(frozen) == "adapting"


def test_every_number_agrees_with_the_statistics():
    """Budget 1.5 and a domain bank: after a stream and a change (noise, then black frames) the
    counters, the guard's signals, bounds and verdicts, the budget and the bank read as
    ``stats()`` does."""
    model = _load(budget=1.5, bank_slots=4)
    black = np.full((16, 3, 32, 32), -1.0, np.float32)
    _walk(model, uniform_batch(256, seed=3))
    for _ in range(20):
        model.step(black)
    stats, values = model.stats(), _samples(model)
    assert values[("eva0_samples_total", ())] == stats["samples"] == 256 + 320
    assert values[("eva0_forwards_total", ())] == stats["forwards"]
    assert stats["forwards"] / stats["samples"] == stats["forwards_per_sample"] > 1.0
    assert values[("eva0_theta_updates_total", ())] == stats["steps"] > 0
    guard = stats["guard"]
    for signal, value in guard["signals"].items():
        assert values.get(("eva0_guard_signal", (("signal", signal),))) == value
    for bound, value in guard["bounds"].items():
        signal, side = bound.rsplit("_", 1)
        assert values.get((f"eva0_guard_bound_{side}", (("signal", signal),))) == value
    for verdict, count in guard["pause_verdicts"].items():
        assert values[("eva0_guard_verdicts_total", (("verdict", verdict),))] == count
    budget = stats["budget"]
    assert values[("eva0_budget_forwards_per_sample", ())] == budget["forwards_per_sample"]
    capacity = values[("eva0_budget_capacity_forwards", ())]
    assert capacity == (1.5 - 1) * budget["burst"]
    credit = values[("eva0_budget_credit_forwards", ())]
    assert min(1.0, max(0.0, credit / capacity)) == budget["fill"]
    bank = stats["bank"]
    for name in ("hits", "misses", "evictions"):
        assert values[(f"eva0_bank_{name}_total", ())] == bank[name]
    assert values[("eva0_bank_slots", ())] == bank["slots"] == 4
    assert values[("eva0_bank_slots_used", ())] == bank["used"]
    changes = values[("eva0_stream_changes_total", (("detector", "inputs"),))]
    assert changes == model.inputs.changes >= 1  # the black frames are a new stream
    shift = stats["activation_shift"]["stream_changes"]
    assert values[("eva0_stream_changes_total", (("detector", "activation_shift"),))] == shift


def test_without_a_budget_or_a_bank_their_series_are_absent():
    model = _load()
    model.step(uniform_batch(16))
    names = {name for name, _ in _samples(model)}
    assert "eva0_samples_total" in names and "eva0_guard_bound_max" in names
    assert not {n for n in names if n.startswith(("eva0_budget_", "eva0_bank_"))}
    assert ("eva0_guard_bound_max", (("signal", "spread"),)) not in _samples(model)  # unchecked


def test_exposition_carries_the_families_of_the_last_scrape_only():
    metrics = ServerMetrics(max_batch=48)
    budgeted, plain = _load(budget=1.5), _load()
    first = {f.name for f in text_string_to_metric_families(
        metrics.exposition(model_families(budgeted)).decode())}
    second = {f.name: f for f in text_string_to_metric_families(
        metrics.exposition(model_families(plain)).decode())}
    assert "eva0_budget_forwards_per_sample" in first
    assert "eva0_budget_forwards_per_sample" not in second
    assert second["eva0_samples"].type == "counter"
    assert second["eva0_max_batch_rows"].samples[0].value == 48


def test_the_metrics_route_reads_the_model_as_the_statistics_route_does():
    model = _load(budget=1.5)
    server = InProcessServer(create_app(model, ServeOptions("m", max_batch=8)))
    try:
        x = uniform_batch(3)
        body = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                       "shape": list(x.shape), "data": x.ravel().tolist()}]})
        assert http_call(server, "POST", "/v2/models/m/infer", body.encode())[0] == 200
        status, text = http_call(server, "GET", "/metrics")
        stats = json.loads(http_call(server, "GET", "/v2/models/m/adaptation/statistics")[1])
    finally:
        server.stop()
    assert status == 200
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text.decode())
              for s in family.samples}
    assert values[("eva0_samples_total", ())] == stats["samples"] == 3
    assert values[("eva0_forwards_total", ())] == stats["forwards"]
    assert values[("eva0_adaptation_state", (("state", "adapting"),))] == 1.0
    assert values[("eva0_max_batch_rows", ())] == 8
    assert values[("eva0_budget_forwards_per_sample", ())] == 1.5
