"""The shipped Prometheus alert rules (``deploy/prometheus/eva0-edge-alerts.yml``): valid for
``promtool check rules``, their unit tests (``eva0-edge-alerts.test.yml``: input series and the
alerts expected, firing and not) pass ``promtool test rules``, every alert carries a severity,
a summary and a description, and every series a rule reads is one a real server exports."""

from __future__ import annotations

import subprocess

import pytest

from tests.monitoring import (
    RULE_TESTS,
    RULES,
    debian_tool,
    every_series_exposition,
    exported_names,
    metric_names,
    rules,
)

SEVERITIES = {"info", "warning", "critical"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([debian_tool("promtool"), *args], capture_output=True, text=True,
                          timeout=120)


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    check = _promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    run = _promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_every_alert_is_tested_and_has_a_severity_a_summary_and_a_description():
    import yaml

    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case["exp_alerts"]}
    for rule in rules():
        assert rule["alert"].startswith("Eva0"), rule
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert rule["alert"] in tested, f"{rule['alert']} never fires in {RULE_TESTS.name}"


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> str:
    return every_series_exposition(tmp_path_factory.mktemp("rules") / "server.log")


def test_every_series_a_rule_reads_is_exported(exposition):
    exported = exported_names(exposition)
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= exported, f"{rule['alert']} reads {sorted(names - exported)}"
