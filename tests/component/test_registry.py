"""One method table: every list, help text and loader is derived from it."""

from __future__ import annotations

import pytest

from eva0_edge.bench.cost import COST_METHODS, check_cost_method
from eva0_edge.bench.testbed.evaluate import BACKPROP, known_methods
from eva0_edge.runtime.cli import RUNTIME_METHOD_HELP
from eva0_edge.runtime.engine import METHODS
from eva0_edge.runtime.foa import FOA_METHODS
from eva0_edge.runtime.methods import RUNTIME_METHODS, load_method
from eva0_edge.runtime.registry import REGISTRY, MethodSpec, method_names, register, spec_of
from eva0_edge.runtime.session import SessionSettings
from tests.fixtures import MODEL


def test_every_list_comes_from_the_table():
    engine, foa, torch = (method_names(kind) for kind in ("engine", "foa", "torch"))
    assert set(METHODS) == set(engine) and set(FOA_METHODS) == set(foa)
    assert RUNTIME_METHODS == engine + foa and BACKPROP == torch
    assert known_methods() == [*RUNTIME_METHODS, *BACKPROP] == list(REGISTRY)
    for name in RUNTIME_METHODS:
        assert name in RUNTIME_METHOD_HELP
    for name in torch:
        assert name not in RUNTIME_METHOD_HELP
    for name in COST_METHODS:
        check_cost_method(name)


def test_specs_parse_fp_and_refuse_unknown_or_duplicate_names():
    assert spec_of("foa-dagger@14").overrides == {"lambda_fit": 0.0, "shift": False}
    assert spec_of("eva0-clubs@8", "engine").prompt_model
    with pytest.raises(ValueError, match="unknown method 'tent'"):
        spec_of("tent", "engine", "foa")
    with pytest.raises(ValueError, match="after @ is #FP"):
        spec_of("eva0@x")
    with pytest.raises(ValueError, match="registered twice"):
        register(MethodSpec("eva0", "engine", 2, "again"))
    with pytest.raises(ValueError, match="kind must be"):
        MethodSpec("x", "gpu", 2, "no such kind")


@pytest.mark.parametrize("name", [n for n in RUNTIME_METHODS if not REGISTRY[n].prompt_model])
def test_every_theta_method_loads_and_steps_on_the_shipped_model(name):
    import numpy as np

    model = load_method(MODEL, name, session=SessionSettings(provider="cpu", threads=1))
    x = np.zeros((2, *model.metadata.preprocessing.input_size), np.float32)
    assert model.step(x).shape == (2, model.metadata.num_classes)
    assert model.stats()["forwards_per_sample"] == REGISTRY[name].forwards_per_sample


@pytest.mark.parametrize("name", method_names("engine", "foa", prompt_model=True))
def test_prompt_methods_refuse_a_theta_model_by_name(name):
    with pytest.raises(ValueError, match="prompt"):
        load_method(MODEL, name, session=SessionSettings(provider="cpu"))
