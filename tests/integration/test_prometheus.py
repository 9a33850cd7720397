"""A real Prometheus (Debian's package) scrapes a real ``eva0-edge serve`` on loopback and
evaluates the shipped alert rules: a hostile stream (the testbed's uniform noise, then black
frames: what a broken or covered camera sends) makes the health guard trip and hold, and the
alerts fire; Fashion-MNIST test images afterwards resolve them. Every duration of the rule file
(``for:`` and range windows) is divided by :data:`TIME_SCALE` so the test runs in seconds; the
expressions and thresholds are the shipped ones. Prometheus's view agrees with the
statistics route at the end."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.fixtures import MODEL, NAME, ServerProcess, free_port, http_call
from tests.monitoring import RULES, dashboard_expressions, debian_tool, send_pixels

TIME_SCALE = 150  # the rule file's 5m becomes 2 s, 1h 24 s
UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION = re.compile(r"(for: |\[)(\d+)([smh])\b")
BATCH = 16
TIMEOUT_S = 60.0  # per phase


def shortened(text: str, scale: int = TIME_SCALE) -> str:
    """The rule file with every ``for:`` duration and range window divided by ``scale`` (at
    least 1 s); nothing else changes."""
    def divided(match: re.Match) -> str:
        seconds = int(match.group(2)) * UNITS[match.group(3)]
        return f"{match.group(1)}{max(1, seconds // scale)}s"

    return DURATION.sub(divided, text)


class Prometheus:
    """``prometheus`` on 127.0.0.1 scraping ``target`` every second and evaluating ``rules``
    every second."""

    def __init__(self, folder: Path, target: str, rules: str) -> None:
        (folder / "rules.yml").write_text(rules)
        (folder / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "eva0", "static_configs": [{"targets": [target]}]}],
        }))
        self.port = free_port()
        self.log_path = folder / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [debian_tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
                 f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.query("up") == [1.0], "the target is up", 30.0, self.log)

    def api(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[float]:
        """The values of an instant query (empty while Prometheus is not answering)."""
        try:
            data = self.api(f"query?query={urllib.request.quote(expr)}")
        except OSError:
            return []
        return [float(r["value"][1]) for r in data["result"]]

    def alerts(self) -> dict[str, str]:
        """The active alerts: name -> pending or firing."""
        return {a["labels"]["alertname"]: a["state"] for a in self.api("alerts")["alerts"]}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def wait_for(condition: Callable[[], bool], what: str, timeout: float,
             log: Callable[[], str] = lambda: "", between: Callable[[], None] | None = None,
             ) -> float:
    """Seconds until ``condition()``; ``between()`` runs before each check."""
    start = time.monotonic()
    while True:
        if between is not None:
            between()
        if condition():
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}\n{log()}"
        time.sleep(0.1)


def cycling(x: np.ndarray) -> Iterator[np.ndarray]:
    """Batches of :data:`BATCH` rows of x, round and round."""
    while True:
        for i in range(0, len(x) - BATCH + 1, BATCH):
            yield x[i : i + BATCH]


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[ServerProcess, Prometheus]]:
    server = ServerProcess(tmp_path / "server.log", "--budget", "1.5", "--set", "bank_slots=4")
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path, server.url, shortened(RULES.read_text()))
        yield server, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        assert server.stop(), server.log()


def test_shortening_divides_the_durations_only():
    text = RULES.read_text()
    short = shortened(text)
    assert DURATION.sub("", text) == DURATION.sub("", short)
    assert "for: 2s" in short and "[24s]" in short and "[48s]" in short
    assert len(DURATION.findall(short)) == len(DURATION.findall(text)) >= 6


def test_a_hostile_stream_fires_the_guards_alerts_and_clean_images_resolve_them(served):
    server, prometheus = served
    preprocessing = read_metadata(MODEL).preprocessing
    images, labels = load_fashion_mnist("test")
    clean = preprocess_uint8(images[:512], preprocessing)
    noise = preprocess_uint8(hostile_images("noise", images[:512], labels[:512], 0)[0],
                             preprocessing)
    black = preprocess_uint8(hostile_images("black", images[:64], labels[:64], 0)[0],
                             preprocessing)
    assert prometheus.alerts() == {}
    start = time.monotonic()

    def feeding(batches: Iterator[np.ndarray]) -> Callable[[], None]:
        return lambda: send_pixels(server, next(batches))

    def firing(*names: str) -> Callable[[], bool]:
        return lambda: all(prometheus.alerts().get(n) == "firing" for n in names)

    tripped = wait_for(firing("Eva0GuardTripped"), "Eva0GuardTripped fires on noise",
                       TIMEOUT_S, prometheus.log, feeding(cycling(noise)))
    held = wait_for(firing("Eva0GuardHolding"), "Eva0GuardHolding fires on black frames",
                    TIMEOUT_S, prometheus.log, feeding(cycling(black)))
    hostile_s = time.monotonic() - start
    resolved = wait_for(lambda: not {"Eva0GuardHolding", "Eva0GuardTripped"}
                        & set(prometheus.alerts()), "the guard's alerts resolve on clean "
                        "images", TIMEOUT_S, prometheus.log, feeding(cycling(clean)))
    print(f"\nEva0GuardTripped fired after {tripped:.1f} s of noise, Eva0GuardHolding after "
          f"{held:.1f} s more of black frames; both resolved after {resolved:.1f} s of clean "
          f"images ({hostile_s + resolved:.1f} s in all)")
    stats = json.loads(http_call(server, "GET", f"/v2/models/{NAME}/adaptation/statistics")[1])
    guard = stats["guard"]
    assert guard["trips"] >= 1 and guard["pause_verdicts"]["hold"] >= 1
    assert prometheus.query('eva0_adaptation_state{state="adapting"}') == [1.0]

    def agreed() -> bool:
        return (prometheus.query("eva0_samples_total") == [stats["samples"]]
                and prometheus.query("eva0_guard_trips") == [guard["trips"]]
                and prometheus.query('eva0_guard_verdicts_total{verdict="hold"}')
                == [guard["pause_verdicts"]["hold"]])

    wait_for(agreed, "Prometheus's numbers agree with the statistics route", 10.0,
             prometheus.log)
    for expr in dashboard_expressions():
        prometheus.api(f"query?query={urllib.request.quote(expr)}")  # valid PromQL, answered
