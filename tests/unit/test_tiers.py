"""A test's tier is its folder (tests/conftest.py), and below the integration tier the data set
is out of reach, so `make test-fast` runs on a machine without Fashion-MNIST."""

from __future__ import annotations

import pytest

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist


def test_the_tier_marker_is_the_folder(request):
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("integration") is None


def test_the_data_set_is_out_of_reach_below_the_integration_tier():
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST not found"):
        load_fashion_mnist("test")
