"""The Python API a user holds: ``from eva0_edge.runtime import AdaptiveModel`` (the name since
the first release) opens the adapting model as served, the policy that owns the engine, and
the package stays light until it is used."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from tests.fixtures import SHIPPED_RESNET_GN


def test_the_public_adaptive_model_is_the_policy_and_steps():
    from eva0_edge.runtime import AdaptiveModel, SessionSettings, load_method
    from eva0_edge.runtime.policy import Policy

    assert AdaptiveModel is Policy
    model = AdaptiveModel.load(SHIPPED_RESNET_GN, method="eva0", provider="cpu", threads=1)
    same = load_method(SHIPPED_RESNET_GN, "eva0", session=SessionSettings("cpu", 1))
    x = np.random.default_rng(0).uniform(-1, 1, (4, 3, 32, 32)).astype(np.float32)
    np.testing.assert_array_equal(model.step(x), same.step(x))
    assert model.stats()["steps"] == 1


def test_importing_the_runtime_package_loads_no_onnxruntime():
    code = "import sys, eva0_edge.runtime; assert 'onnxruntime' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
