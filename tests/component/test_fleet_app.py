"""The fleet's Ray Serve application builder takes typed arguments, as Serve's documented typed
builders do: Serve finds the model in ``build``'s annotation at run time and validates the
string arguments of ``serve run eva0_edge.fleet.app:build key=value ...`` into it."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("ray.serve")

from pydantic import ValidationError  # noqa: E402

from eva0_edge.fleet.app import FleetArgs, build  # noqa: E402
from eva0_edge.runtime.server.options import serve_defaults  # noqa: E402


def test_serve_sees_the_builders_argument_model():
    (param,) = inspect.signature(build).parameters.values()
    assert param.annotation is FleetArgs  # a string (postponed annotations) would hide it


def test_string_arguments_become_typed_values_with_the_servers_defaults():
    args = FleetArgs.model_validate({"model": "m.onnx", "replicas": "3", "threads": "1",
                                     "sync_every_s": "0.5"})
    assert (args.replicas, args.threads, args.sync_every_s) == (3, 1, 0.5)
    defaults = serve_defaults()
    assert (args.max_batch, args.max_delay_ms) == (defaults["max_batch"],
                                                   defaults["max_delay_ms"])
    assert (args.method, args.combine, args.name) == ("eva0", "mean", None)


@pytest.mark.parametrize("bad", [
    {"replicas": "2"},  # no model
    {"model": "m.onnx", "replica": "2"},  # unknown name
    {"model": "m.onnx", "replicas": "0"},
    {"model": "m.onnx", "combine": "max"},
    {"model": "m.onnx", "max_batch": "many"},
])
def test_a_bad_or_unknown_argument_is_refused_by_name(bad):
    with pytest.raises(ValidationError) as err:
        FleetArgs.model_validate(bad)
    assert ({"replicas", "replica", "combine", "max_batch", "model"} &
            {str(e["loc"][0]) for e in err.value.errors()})
