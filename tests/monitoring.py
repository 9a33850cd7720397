"""What the monitoring tests share (the alert rules, the Grafana dashboard, a real Prometheus):
the shipped files, Debian's ``prometheus`` / ``promtool`` (missing: a failure under ``CI``, a
skip elsewhere), the PromQL expressions of the files with the metric names they read, and a
real server exporting every series (a budget and a domain bank on, real images served)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import NAME, ROOT, ServerProcess, http_call

RULES = ROOT / "deploy" / "prometheus" / "eva0-edge-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "eva0-edge-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "eva0-edge-dashboard.json"
# What a server with every series runs with: a budget and a domain bank
ALL_SERIES = ("--budget", "1.5", "--set", "bank_slots=4")
# Grafana's variables, as a query a test sends or checks names them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$instance": ".*"}


def debian_tool(name: str) -> str:
    """The path of Debian's ``name`` (package ``prometheus``); without it the test fails under
    ``CI`` (which installs it) and skips elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: apt-get install prometheus (Debian's package)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def rules() -> list[dict[str, Any]]:
    """Every rule of the shipped rule file."""
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard (panel targets and annotations), its Grafana
    variables as :data:`GRAFANA_VARIABLES` sets them."""
    return [grafana_substituted(expr) for expr in _expressions(dashboard())]


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [e for key, value in node.items() for e in (
            [value] if key == "expr" and isinstance(value, str) else _expressions(value))]
    if isinstance(node, list):
        return [e for item in node for e in _expressions(item)]
    return []


def grafana_substituted(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The eva0-edge series an expression reads (every name starting ``eva0_``)."""
    return set(re.findall(r"\beva0_[a-z0-9_]+\b", expr))


def exported_names(exposition: str) -> set[str]:
    """The sample names of a text exposition (``eva0_x_total``, ``eva0_y_bucket``, ...)."""
    return {line.split("{")[0].split(" ")[0] for line in exposition.splitlines()
            if line and not line.startswith("#")}


def serve_every_series(log: Path) -> ServerProcess:
    """A real server with a budget and a domain bank, 64 Fashion-MNIST test images served (one
    request of 8 refused, so ``eva0_requests_total`` has a 4xx too): every series it exports is
    there."""
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
    from eva0_edge.runtime.modelfile import read_metadata
    from eva0_edge.runtime.preprocess import preprocess_uint8
    from tests.fixtures import MODEL

    server = ServerProcess(log, *ALL_SERIES)
    x = preprocess_uint8(load_fashion_mnist("test")[0][:64], read_metadata(MODEL).preprocessing)
    for i in range(0, 64, 8):
        send_pixels(server, x[i : i + 8])
    status, _ = http_call(server, "POST", f"/v2/models/{NAME}/infer", b"{}")
    assert status == 400
    return server


def every_series_exposition(log: Path) -> str:
    """``/metrics`` as :func:`serve_every_series`'s server answers it (the server then stopped)."""
    server = serve_every_series(log)
    try:
        status, body = http_call(server, "GET", "/metrics")
    finally:
        assert server.stop(), server.log()
    assert status == 200
    return body.decode()


def send_pixels(server: ServerProcess, x: Any) -> None:
    """One inference request of the normalised images x [B, 3, H, W] (binary FP32)."""
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    server.client.infer(NAME, [tensor])
