"""``eva0-edge eval --ray``: the cells as tasks on a real local Ray instance give the local
run's numbers to the digit."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate
from eva0_edge.runtime.session import SessionSettings
from tests.fixtures import MODEL


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance as the product starts one (loopback only); CI installs Ray, so a
    broken Ray fails here instead of skipping."""
    from eva0_edge.fleet.serve import init_ray, shutdown

    init_ray(num_cpus=2)
    yield
    shutdown()


@pytest.mark.parametrize("protocol", ["single", "continual"])
def test_fan_out_equals_the_local_run(local_ray, protocol, tmp_path):
    from eva0_edge.bench.fanout import evaluate_on_ray

    spec = EvalSpec(
        model=str(MODEL), dataset="fmnist-c", protocol=protocol, severity=5, batch_size=8,
        methods=["noadapt", "eva0"], batch_sizes=[1, 8],
        corruptions=["gaussian_noise", "fog", "contrast"], limit=24,
        session=SessionSettings(threads=1),
    )
    local = evaluate(spec, progress=False)
    fanned = evaluate_on_ray(spec, out_dir=tmp_path)
    assert list(fanned) == list(local)
    for key, result in local.items():
        assert fanned[key].accuracy == result.accuracy, key
        np.testing.assert_array_equal(fanned[key].batch_correct, result.batch_correct)
        np.testing.assert_allclose(fanned[key].drift, result.drift, rtol=1e-6)
    assert (tmp_path / "results.json").is_file()
