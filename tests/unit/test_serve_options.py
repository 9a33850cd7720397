"""Every number of the server's settings is range-checked when they are made, naming the
option: a non-finite delay, body limit, pixel budget or timeout never reaches a running server
(issue 50: ``--max-delay-ms inf`` killed the worker thread, a non-finite pixel budget made every
request a 500, a negative body limit every request a 413)."""

from __future__ import annotations

import math

import pytest

from eva0_edge.runtime.server.options import LIMITS, ServeOptions


@pytest.mark.parametrize("field", sorted(LIMITS))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1, "ten"])
def test_a_number_out_of_range_is_refused_by_its_option(field, value):
    option = LIMITS[field][0]
    with pytest.raises(ValueError, match=f"^{option} must be a"):
        ServeOptions("m", **{field: value})


def test_the_bounds_themselves():
    ServeOptions("m", max_delay_ms=0.0, max_batch=1, snapshot_every=1, keep_snapshots=1)
    ServeOptions("m", max_delay_ms=60_000.0)
    for field, value in (("max_delay_ms", 60_001.0), ("max_batch", 0), ("max_body_mb", 0.0),
                         ("header_timeout_s", 0.0), ("summary_every_s", 0.0)):
        with pytest.raises(ValueError, match=LIMITS[field][0]):
            ServeOptions("m", **{field: value})


def test_the_defaults_are_in_range():
    ServeOptions("m")
