"""The device step's algorithm on the CPU: :class:`DeviceEstimator` over NumPy arrays (the code
CuPy runs on a GPU) against the host estimator. Given the same perturbations both estimate the
same coefficients (the objective is the host's, float64) and the same gradient up to its
float32 sum, in every variant of the estimator; a session asked for the device step where it
cannot run is refused by name. (With its own generator it agrees statistically:
tests/integration/test_device_step_stream.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.device_step import DeviceEstimator
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import SHIPPED_RESNET_GN, SHIPPED_VIT, uniform_batch


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


VARIANTS = [{}, {"two_sided": False}, {"sample_wise": False}, {"forwards": 4},
            {"regenerate_z": True}, {"anchor_per_64": 16.0}]


@pytest.mark.parametrize("path", [SHIPPED_RESNET_GN, SHIPPED_VIT], ids=lambda p: p.stem)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "default")
def test_same_perturbations_give_the_host_estimate_in_float32(path, variant):
    policy = Policy.load(path, "eva0", {"guard": False, **variant}, seed=0, provider="cpu")
    engine = policy.model
    x = engine.session.check_input(uniform_batch(8, seed=1))
    for _ in range(2):  # moments and the coefficient scale from real steps
        policy.step(x)
    host = engine.estimator
    device = DeviceEstimator(engine.session, engine.config, host.objective, np)
    device.perturbations = lambda plan: plan.draw()  # the host's stream, not Philox
    state, n_anchor = engine.state, 2 if "anchor_per_64" in variant else 0
    want = host.estimate(x, state, 0, state.step, n_anchor, control=True)
    got = device.estimate(x, state, 0, state.step, n_anchor, control=True)
    np.testing.assert_array_equal(got.coef, want.coef)
    assert _relative(got.grad, want.grad) < 1e-5  # summed in float32
    for name in ("prediction", "h_mean", "h_sq"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert got.control.clipped == want.control.clipped


def test_anchor_rows_follow_the_anchor_and_the_rest_are_normal():
    policy = Policy.load(SHIPPED_RESNET_GN, "eva0", {"guard": False}, seed=0, provider="cpu")
    engine = policy.model
    x = engine.session.check_input(uniform_batch(16, seed=1))
    policy.step(x)
    engine.state.anchor = engine.state.theta + 1.0  # a direction to follow
    device = DeviceEstimator(engine.session, engine.config, engine.estimator.objective, np)
    prepared = device.prepare(x, engine.state, 0, 5, 3)
    plan = prepared.plan
    assert prepared.z_all is None  # drawn again for the gradient, not held
    z = device.perturbations(plan)
    assert len(plan.anchor_rows) == 3
    for row in range(plan.rows):
        if row in plan.anchor_rows:  # d_bar * U(0, 2): the anchor's direction, never against
            assert (z[row] / plan.d_bar > 0).all()
        else:
            assert abs(float(z[row].std()) - 1.0) < 0.05
    theta = engine.state.theta
    mu = np.float32(engine.config.mu)
    np.testing.assert_array_equal(prepared.rows[:16], theta + mu * z)
    np.testing.assert_array_equal(prepared.rows[16:], theta - mu * z)


def test_a_session_refuses_the_device_step_where_it_cannot_run():
    assert not AdaptableSession(SHIPPED_VIT, provider="cpu").device_step
    with pytest.raises(ValueError, match="device_step: it needs the CUDA provider"):
        AdaptableSession(SHIPPED_VIT, provider="cpu", device_step=True)
