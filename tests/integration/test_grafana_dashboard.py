"""The shipped Grafana dashboard (``deploy/grafana/eva0-edge-dashboard.json``): its Prometheus
datasource is a variable chosen at import, it has the operator's panels, every expression in it
is valid PromQL (``promtool check rules`` over them as recording rules) and reads only series a
real server exports."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.monitoring import (
    dashboard,
    dashboard_expressions,
    debian_tool,
    every_series_exposition,
    exported_names,
    metric_names,
)

PANELS = ("Images/s", "Latency p50 / p99", "Forwards per sample vs budget", "Budget credit",
          "Drift from theta0", "Entropy vs the guard's bounds", "Alignment vs the guard's bound",
          "Adaptation state", "Guard trips, audits and verdicts", "Stream changes",
          "Domain bank")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _queries(node) -> list[dict]:
    """Every object of the dashboard that carries an ``expr`` (targets, annotations)."""
    if isinstance(node, dict):
        return ([node] if "expr" in node else []) + [q for v in node.values()
                                                     for q in _queries(v)]
    if isinstance(node, list):
        return [q for item in node for q in _queries(item)]
    return []


def test_the_datasource_is_a_variable_and_every_query_uses_it():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == DATASOURCE
    queries = _queries(board)
    assert len(queries) >= len(PANELS)
    for query in queries:
        assert query["datasource"] == DATASOURCE, query
    for panel in board["panels"]:
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
    assert "DS_" not in json.dumps(board)  # no datasource of the exporting Grafana left in


def test_it_has_the_operators_panels_once_each_on_the_grid():
    panels = dashboard()["panels"]
    assert [p["title"] for p in panels] == list(PANELS)
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_every_expression_is_valid_promql(tmp_path):
    rules = tmp_path / "dashboard.rules.yml"
    rules.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expression_{i}", "expr": expr}
        for i, expr in enumerate(dashboard_expressions())]}]}))
    run = subprocess.run([debian_tool("promtool"), "check", "rules", str(rules)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> str:
    return every_series_exposition(tmp_path_factory.mktemp("dashboard") / "server.log")


def test_every_series_the_dashboard_reads_is_exported(exposition):
    exported = exported_names(exposition)
    variable = dashboard()["templating"]["list"][1]["definition"]
    (listed,) = re.findall(r"label_values\((\w+), instance\)", variable)
    assert listed in exported
    read: set[str] = set()
    for expr in dashboard_expressions():
        names = metric_names(expr)
        assert names and names <= exported, f"{expr} reads {sorted(names - exported)}"
        read |= names
    assert {"eva0_bank_hits_total", "eva0_budget_credit_forwards", "eva0_adaptation_state",
            "eva0_request_latency_seconds_bucket", "eva0_guard_signal"} <= read
