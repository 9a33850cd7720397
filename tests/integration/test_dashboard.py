"""The operator's page (``GET /dashboard``) in a real browser: Debian's headless Chromium driven
by Selenium through Debian's chromedriver, against a real ``eva0-edge serve`` on loopback.

A known stream (clean images, black frames, clean images again; the guard's alignment bound
tightened and its audit at a change off, so the black frames trip it, its pause and hold follow,
and the return to clean is a change the domain bank recalls) runs while the page polls. Then
every chart's latest number is the statistics route's, the guard's trip and verdict marks are
drawn, the page keeps updating with no traffic, the browser logged no console error, and every
request it made went to the server's own origin.

Behind a load balancer (a round-robin proxy in the test, in front of two servers named by
``--replica-id``, as a fleet's proxy alternates between its replicas), the page keeps each
replica's points apart: one line per replica in every chart, each replica's latest numbers its
own statistics' and series', none of its points missed or doubled.

Without Chromium or chromedriver the test skips, except under ``CI=true`` (``.ci/run``), where
it fails: CI installs both (``make monitoring-tools``). ``EVA0_DASHBOARD_SCREENSHOT=PATH`` also
writes the page's screenshot to PATH (``docs/guide/dashboard.png`` is one)."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.fixtures import MODEL, NAME, ServerProcess, http_call

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ROWS = 8  # images per request
SERIES = f"/v2/models/{NAME}/adaptation/series"
STATISTICS = f"/v2/models/{NAME}/adaptation/statistics"


def unavailable(reason: str) -> None:
    """Skip locally; fail under CI, which installs the browser."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason} (make monitoring-tools installs Chromium and "
                    "chromedriver)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        unavailable(f"no {' and no '.join(missing)} (Debian's chromium and chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (the [dev] extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1500", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-default-apps", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("dashboard") / "server.log", "--budget", "1.5",
        "--set", "bank_slots=4", "--set", "guard_change_audit=off",
        "--set", "guard_alignment_max=0.02",
    )
    yield process
    assert process.stop(), process.log()


def get_json(server: ServerProcess, path: str) -> dict:
    status, body = http_call(server, "GET", path)
    assert status == 200, body
    return json.loads(body)


def send_stream(server: ServerProcess) -> None:
    """400 clean images, 400 black frames, 800 clean images, ``ROWS`` per request."""
    import tritonclient.http as httpclient

    pre = read_metadata(MODEL).preprocessing
    clean = preprocess_uint8(load_fashion_mnist("test")[0][:1200], pre)
    black = preprocess_uint8(np.zeros((ROWS, 32, 32, 3), np.uint8), pre)
    batches = [clean[i : i + ROWS] for i in range(0, 400, ROWS)] + [black] * (400 // ROWS) + \
        [clean[i : i + ROWS] for i in range(400, 1200, ROWS)]
    for x in batches:
        tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        tensor.set_data_from_numpy(np.ascontiguousarray(x))
        server.client.infer(NAME, [tensor])


def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def shown(driver) -> dict[str, str]:
    """Every chart's latest numbers as the page shows them: {chart/field: data-value}, the
    latest-point table's as {field: data-value}, and the page's status attributes."""
    return driver.execute_script("""
        const out = {charts: {}, table: {}, status: {}, marks: {}};
        for (const fig of document.querySelectorAll('figure.chart')) {
          for (const span of fig.querySelectorAll('.latest'))
            out.charts[fig.dataset.chart + '/' + span.dataset.field] = span.dataset.value;
          out.marks[fig.dataset.chart] = fig.querySelector('.uplot').dataset.marks;
        }
        for (const row of document.querySelectorAll('#latest tr'))
          out.table[row.dataset.field] = row.querySelector('td').dataset.value;
        Object.assign(out.status, document.getElementById('status').dataset);
        out.guard = document.getElementById('guard-state').dataset.state;
        out.events = [...document.querySelectorAll('#events li')].map(
          (li) => [li.dataset.kind, li.textContent]);
        return out;
    """)


def number(text: str) -> float | None:
    return None if text == "null" else float(text)


def test_the_page_charts_what_the_statistics_report_and_loads_only_from_the_server(
        browser, server, tmp_path):
    origin = f"http://127.0.0.1:{server.port}"
    browser.get(origin + "/dashboard")
    wait_for(lambda: int(shown(browser)["status"].get("polls", "0")) >= 1, "the first poll")

    send_stream(server)
    stats = get_json(server, STATISTICS)
    samples = stats["samples"]
    # the page's latest point is one closed after the stream, with every image in the points
    page = wait_for(lambda: (lambda p: p if number(p["table"]["samples"]) == samples and
                             number(p["table"]["images_total"]) == samples else None)(
        shown(browser)), f"a point with all {samples} samples")
    assert get_json(server, STATISTICS) == stats  # nothing moved since (no traffic)
    guard, budget = stats["guard"], stats["budget"]
    charts = page["charts"]
    expected = {
        "forwards/forwards_per_sample": stats["forwards_per_sample"],
        "credit/budget_fill": budget["fill"],
        "drift/drift": stats["drift"],
        "entropy/entropy": guard["signals"]["entropy"],
        "alignment/alignment": guard["signals"]["alignment"],
        "changes/input_changes": stats["input_changes"],
        "changes/shift_changes": stats["activation_shift"]["stream_changes"],
        "changes/bank_hits": stats["bank"]["hits"],
    }
    for key, value in expected.items():
        assert number(charts[key]) == value, (key, charts[key], value)
    table = page["table"]
    for field, value in {"trips": guard["trips"], "audits": guard["audits"],
                         "steps": stats["steps"], "forwards": stats["forwards"],
                         "mean_entropy": stats["mean_entropy"],
                         **{f"verdicts_{k}": v for k, v in guard["pause_verdicts"].items()}
                         }.items():
        assert number(table[field]) == value, (field, table[field], value)
    # what the statistics do not hold (rates, latency, state) as the series route has it
    series = get_json(server, SERIES)
    points = series["points"]
    last = points["t"].index(number(table["t"]))
    for key in ("throughput/images_per_s", "latency/latency_p50_ms", "latency/latency_p99_ms",
                "forwards/forwards_per_sample_interval"):
        assert number(charts[key]) == points[key.split("/")[1]][last], key
    assert charts["guard/guard_state"] == page["guard"] == points["guard_state"][last]
    assert page["guard"] == "adapting" and stats["paused_samples_left"] == 0
    assert sum(points["images"]) == samples

    # the stream tripped the guard, paused, held and resumed: in the series and on the page
    assert guard["trips"] >= 1 and guard["pause_verdicts"]["hold"] >= 1, guard
    seen = {state for states in points["guard_states_seen"] for state in states}
    assert {"holding", "adapting"} <= seen and seen & {"paused", "dueling"}, \
        points["guard_states_seen"]  # the trip's pause: dueling while a checkpoint differs
    assert charts["guard/guard_states_seen"] == max(
        points["guard_states_seen"][last], key=series["guard_states"].index)
    kinds = [kind for kind, _ in page["events"]]
    assert {"trip", "verdict", "stream_change", "bank_hit"} <= set(kinds), page["events"]
    trips = [text for kind, text in page["events"] if kind == "trip"]
    assert any(guard["last_reason"] in text for text in trips), (trips, guard["last_reason"])
    for chart, marks in page["marks"].items():  # every event marked on every chart
        assert int(marks) == len(series["events"]), (chart, marks, series["events"])

    # it keeps updating while idle: later polls bring newer points
    before = number(page["status"]["lastT"])
    wait_for(lambda: number(shown(browser)["status"]["lastT"] or "null") > before + 1.5,
             "newer points", timeout=30)
    assert shown(browser)["status"]["error"] == ""

    urls = [message["params"]["request"]["url"] for message in (
        json.loads(entry["message"])["message"] for entry in browser.get_log("performance"))
        if message["method"] == "Network.requestWillBeSent"]
    assert {origin + "/dashboard/uPlot.iife.min.js", origin + "/dashboard/dashboard.js",
            origin + SERIES} <= set(urls), urls
    elsewhere = [url for url in urls if not url.startswith(origin + "/")]
    assert elsewhere == [], elsewhere
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], errors

    screenshot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(screenshot))
    if os.environ.get("EVA0_DASHBOARD_SCREENSHOT"):
        from PIL import Image

        Image.open(screenshot).convert("RGB").quantize(64).save(
            os.environ["EVA0_DASHBOARD_SCREENSHOT"], optimize=True)


class RoundRobin:
    """A reverse proxy on loopback sending each GET to the next of ``turns`` (ports) in turn.
    Not a strict alternation: a balancer shared with other clients, or a fleet's, may send the
    page's polls to one replica several times in a row, while the others' points go on."""

    def __init__(self, turns: list[int]) -> None:
        turn = itertools.cycle(turns)
        lock = threading.Lock()

        class Forward(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with lock:
                    port = next(turn)
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", self.path)
                answer = conn.getresponse()
                body = answer.read()
                conn.close()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("content-length", "connection", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two servers named ``a`` and ``b`` and a proxy in front of them: a, a, b, a, a, b, ..."""
    tmp = tmp_path_factory.mktemp("replicas")
    started = {}
    try:
        for name in ("a", "b"):
            started[name] = ServerProcess(tmp / f"{name}.log", "--budget", "1.5",
                                          "--replica-id", name)
        proxy = RoundRobin([started["a"].port, started["a"].port, started["b"].port])
        yield started, proxy
        proxy.close()
    finally:
        for process in started.values():
            assert process.stop(), process.log()


def shown_replicas(driver) -> dict:
    """Per chart, every latest number the page shows with its replica and its line's points;
    the replicas' list; the status; the latest-point table's ``t``."""
    return driver.execute_script("""
        const out = {charts: {}, replicas: {}, status: {}};
        for (const fig of document.querySelectorAll('figure.chart'))
          out.charts[fig.dataset.chart] = [...fig.querySelectorAll('.latest')].map((span) => ({
            field: span.dataset.field, replica: span.dataset.replica || null,
            value: span.dataset.value, points: span.dataset.points}));
        for (const li of document.querySelectorAll('#replicas li'))
          out.replicas[li.dataset.replica] = Object.assign({}, li.dataset);
        out.hidden = document.getElementById('replicas').hidden;
        Object.assign(out.status, document.getElementById('status').dataset);
        const t = document.querySelector('#latest tr[data-field="t"] td');
        out.t = t ? t.dataset.value : null;
        return out;
    """)


def send_paced(process: ServerProcess, x: np.ndarray, pause_s: float = 0.1) -> None:
    """``x`` in requests of ``ROWS`` rows, ``pause_s`` apart (a stream spread over several of
    the page's polls, so that both replicas close points while the page reads either)."""
    for i in range(0, len(x), ROWS):
        rows = x[i : i + ROWS]
        body = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                       "shape": list(rows.shape),
                                       "data": rows.ravel().tolist()}]})
        status, answer = http_call(process, "POST", f"/v2/models/{NAME}/infer", body.encode(),
                                   {"Content-Type": "application/json"})
        assert status == 200, answer
        time.sleep(pause_s)


def test_behind_a_load_balancer_each_replica_is_charted_apart(browser, replicas):
    servers, proxy = replicas
    origin = f"http://127.0.0.1:{proxy.port}"
    browser.get(origin + "/dashboard")
    wait_for(lambda: shown_replicas(browser)["status"].get("replicas") == "2", "both replicas")

    pre = read_metadata(MODEL).preprocessing
    clean = preprocess_uint8(load_fashion_mnist("test")[0][:240], pre)
    black = preprocess_uint8(np.zeros((160, 32, 32, 3), np.uint8), pre)
    streams = {"a": clean, "b": np.concatenate([black, clean[:80]])}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda name: send_paced(servers[name], streams[name]), streams))
    stats = {name: get_json(process, STATISTICS) for name, process in servers.items()}
    assert stats["a"]["samples"] == 240 and stats["b"]["samples"] == 240
    assert stats["a"]["drift"] != stats["b"]["drift"]  # the replicas' numbers differ
    # each replica's own numbers, by chart/field
    expected = {name: {
        "forwards/forwards_per_sample": s["forwards_per_sample"],
        "credit/budget_fill": s["budget"]["fill"], "drift/drift": s["drift"],
        "changes/input_changes": s["input_changes"],
        "changes/shift_changes": s["activation_shift"]["stream_changes"],
    } for name, s in stats.items()}

    def latest(page: dict) -> dict:
        return {(span["replica"], f"{chart}/{span['field']}"): span["value"]
                for chart, spans in page["charts"].items() for span in spans}

    page = wait_for(lambda: (lambda p: p if all(
        number(latest(p).get((name, key), "null")) == value
        for name, values in expected.items()
        for key, value in values.items()) else None)(shown_replicas(browser)),
        "each replica's numbers after its stream")
    polls = int(page["status"]["polls"])  # a few more polls, b's answers among them
    page = wait_for(lambda: (lambda p: p if int(p["status"]["polls"]) >= polls + 6 else None)(
        shown_replicas(browser)), "six more polls")
    assert {name: get_json(process, STATISTICS) for name, process in servers.items()} == stats
    assert not page["hidden"] and set(page["replicas"]) == {"a", "b"}
    held = page["replicas"]
    for chart, spans in page["charts"].items():  # one line per replica and series
        fields = {span["field"] for span in spans}
        assert sorted((s["field"], s["replica"]) for s in spans) == sorted(
            (field, name) for field in fields for name in ("a", "b")), (chart, spans)
        for span in spans:  # each line holds its replica's points, every one
            assert span["points"] == held[span["replica"]]["points"], (chart, span, held)
    for name, process in servers.items():
        own = get_json(process, SERIES)["points"]
        first, last = float(held[name]["firstT"]), float(held[name]["lastT"])
        # the page holds every point of the replica's from its first to its newest, once
        assert int(held[name]["points"]) == sum(first <= t <= last for t in own["t"]) > 0
        at = own["t"].index(last)
        shown = latest(page)
        for key in ("throughput/images_per_s", "latency/latency_p99_ms",
                    "forwards/forwards_per_sample_interval"):
            assert number(shown[name, key]) == own[key.split("/")[1]][at], (name, key)
        assert shown[name, "guard/guard_state"] == held[name]["state"] == \
            own["guard_state"][at]
    answered = page["status"]["answered"]
    assert answered in ("a", "b") and held[answered]["answered"] == "true"
    assert number(page["t"]) == float(held[answered]["lastT"])  # the table: the last answer's
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], errors
