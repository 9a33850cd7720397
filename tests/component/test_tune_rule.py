"""The tuning rule's choice (eva0_edge.bench.testbed.tuning, which models/recipes/tune.py runs)
under a compute budget: a configuration that spends its budget (and the full bucket it starts
with) stays eligible; one that spends more does not."""

from __future__ import annotations

import pytest

from eva0_edge.bench.testbed import tuning
from eva0_edge.bench.testbed.protocols import StreamResult
from eva0_edge.runtime.budget import forwards_bound


@pytest.fixture(scope="module")
def tune():
    return tuning


def continual(batch: int, samples: int, burst: int | None) -> StreamResult:
    result = StreamResult("eva0", {"fog": 80.0, "snow": 70.0}, batch)
    result.batch_size = [batch] * (samples // batch)
    result.final_stats = {"budget": None if burst is None else {"burst": burst}}
    return result


def test_the_bound_is_the_budget_plus_its_starting_bucket_and_a_batch(tune):
    run = continual(64, 15040, 1024)
    assert tune.spending_bound(1.5, "continual", run) == pytest.approx(
        1.5 + (0.5 * 1024 + 64) / 15040)
    # the single protocol restarts the bucket with every domain: half the samples each here
    assert tune.spending_bound(1.5, "single", run) == forwards_bound(1.5, 1024, 7520, 64)
    assert tune.spending_bound(1.5, "continual", continual(64, 15040, None)) == 1.5


def test_a_configuration_that_spends_its_budget_is_eligible(tune):
    """The tuning log of a budget of 1.5 measured 1.5008 forwards per sample on 15000 samples
    (the bucket starts full): eligible; 1.55 is more than the bucket can explain: not."""
    reference = {"continual B=64": 70.0, "clean B=64": 90.0}
    bound = forwards_bound(1.5, 1024, 15000, 64)

    def row(name: str, accuracy: float, forwards: float, logged_bound: bool = True) -> dict:
        return {"config": {"name": name}, "cells": {"continual B=64": accuracy, "clean B=64": 90.0},
                "forwards": {"continual B=64": forwards},
                **({"forwards_bound": {"continual B=64": bound}} if logged_bound else {})}

    spends = row("spends", 75.0, 1.5008)
    overspends = row("overspends", 76.0, 1.55)
    assert tune.choose([spends, overspends], reference, 0.5, 1.5) is spends
    assert spends["eligible"] and not overspends["eligible"]
    # a log without bounds (written before they were) is held to the budget itself
    old = row("old", 75.0, 1.5008, logged_bound=False)
    tune.choose([old], reference, 0.5, 1.5)
    assert not old["eligible"]
