"""The series route and the dashboard's files on an in-process server (the shipped ResNet-GN):
the protocol's errors, the page's headers, the 503 without uPlot, and the series agreeing
with the statistics route after a stream, in both serving modes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import eva0_edge.runtime.server.routes_dashboard as routes
from eva0_edge.cli import main
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server.app import ServeOptions, create_app
from tests.fixtures import MODEL, NAME, InProcessServer, http_call, uniform_batch

SERIES = f"/v2/models/{NAME}/adaptation/series"
STATISTICS = f"/v2/models/{NAME}/adaptation/statistics"


def serve(name: str = NAME, asynchronous: bool = False, replica: str | None = None,
          **config) -> InProcessServer:
    model = Policy.load(MODEL, "eva0", config or None, provider="cpu", threads=1)
    return InProcessServer(create_app(model, ServeOptions(
        name=name, max_batch=16, asynchronous=asynchronous, replica=replica)))


@pytest.fixture(scope="module")
def server():
    process = serve()
    yield process
    process.stop()


def infer(server, x: np.ndarray) -> None:
    body = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                   "shape": list(x.shape), "data": x.ravel().tolist()}]})
    status, answer = http_call(server, "POST", f"/v2/models/{NAME}/infer", body.encode(),
                               {"Content-Type": "application/json"})
    assert status == 200, answer


def get(server, path: str) -> tuple[int, dict]:
    status, body = http_call(server, "GET", path)
    return status, json.loads(body)


@pytest.mark.parametrize("since", ["abc", "-1", "inf", "nan", ""])
def test_a_bad_since_is_refused_with_the_protocols_error(server, since):
    status, body = get(server, f"{SERIES}?since={since}")
    assert status == 400 and "since must be a finite number" in body["error"]


def test_a_lone_server_names_no_replica(server):
    status, body = get(server, SERIES)
    assert status == 200 and body["replica"] is None


def test_each_replica_names_itself_in_its_series():
    """Two servers of one model, as behind a load balancer: each answer names the replica that
    answered, and its points are that replica's own (the one that served more counts more)."""
    replicas = {"replica-a": serve(replica="replica-a"), "replica-b": serve(replica="replica-b")}
    try:
        x = uniform_batch(16, seed=4)
        for rows, process in zip((8, 16), replicas.values(), strict=True):
            infer(process, x[:rows])
        time.sleep(1.1)  # over the interval: the next read closes a point
        for name, process in replicas.items():
            status, body = get(process, SERIES)
            _, stats = get(process, STATISTICS)
            assert status == 200 and body["replica"] == name, body["replica"]
            assert body["points"]["samples"][-1] == stats["samples"]
            assert sum(body["points"]["images"]) == stats["samples"]
            _, newer = get(process, f"{SERIES}?since={body['points']['t'][-1]}")
            assert newer["replica"] == name
        assert [get(p, STATISTICS)[1]["samples"] for p in replicas.values()] == [8, 16]
    finally:
        for process in replicas.values():
            process.stop()


def test_a_replica_name_is_checked(capsys):
    for bad in ("", "x" * 101):
        with pytest.raises(ValueError, match="--replica-id must be 1..100 characters"):
            ServeOptions(name=NAME, replica=bad)
    # a fleet's replicas answer their own ids: one name for them all is refused
    assert main(["serve", "--model", str(MODEL), "--replicas", "2", "--replica-id", "a"]) == 2
    assert "with --replicas each replica answers its own id" in capsys.readouterr().err


def test_another_models_series_is_404(server):
    status, body = get(server, "/v2/models/other/adaptation/series")
    assert status == 404 and "unknown model 'other'" in body["error"]


def test_only_the_pages_own_files_are_served(server):
    for path in ("/dashboard/index.html", "/dashboard/series.py", "/dashboard/x.js"):
        status, body = get(server, path)
        assert status == 404 and "no such dashboard file" in body["error"], path
    status, body = get(server, "/dashboard/..%2Fseries.py")
    assert status == 404 and "no such route" in body["error"]
    status, body = http_call(server, "GET", "/dashboard/dashboard.js")
    assert status == 200 and b"adaptation/series" in body


def test_the_page_names_the_model_escaped_and_may_load_from_its_origin_only():
    process = serve(name='m"<b>')
    try:
        conn_status, body = http_call(process, "GET", "/dashboard")
        assert conn_status == 200, body
        page = body.decode()
        assert 'data-model="m&quot;&lt;b&gt;"' in page and "<b>" not in page
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", process.port, timeout=30)
        conn.request("GET", "/dashboard")
        headers = conn.getresponse().headers
        conn.close()
        assert headers["Content-Security-Policy"] == routes.PAGE_POLICY
        assert "default-src 'none'" in routes.PAGE_POLICY
        assert "connect-src 'self'" in routes.PAGE_POLICY
        assert headers["X-Content-Type-Options"] == "nosniff"
    finally:
        process.stop()


def test_without_uplot_the_page_answers_503_naming_the_setup_step(server, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(routes, "VENDOR_DIR", tmp_path)
    status, body = get(server, "/dashboard")
    assert status == 503 and "make setup" in body["error"] and "npm ci" in body["error"]
    status, body = get(server, "/dashboard/uPlot.min.css")
    assert status == 503 and "uPlot.min.css" in body["error"]
    assert get(server, SERIES)[0] == 200


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_series_agrees_with_the_statistics_after_a_stream(asynchronous):
    """48 requests of 4 rows; a second later (an idle point closes when the series is read)
    the last point is what the statistics report, the points hold every image, and ``since``
    answers only newer points."""
    process = serve(asynchronous=asynchronous, budget=1.5)
    try:
        x = uniform_batch(192, seed=3)
        for i in range(0, 192, 4):
            infer(process, x[i : i + 4])
        time.sleep(1.1)  # over the interval (1 s): the next read closes a point
        _, series = get(process, SERIES)
        _, stats = get(process, STATISTICS)
        points = series["points"]
        last = {field: column[-1] for field, column in points.items()}
        assert last["samples"] == stats["samples"]
        assert last["forwards_per_sample"] == stats["forwards_per_sample"]
        assert last["drift"] == stats["drift"]
        assert last["budget_fill"] == stats["budget"]["fill"]
        assert last["mean_entropy"] == stats["mean_entropy"]
        assert last["input_changes"] == stats["input_changes"]
        assert last["steps"] == stats["steps"]
        assert sum(points["requests"]) == 48 and sum(points["images"]) == 192
        assert series["bounds"]["budget"] == 1.5
        _, newer = get(process, f"{SERIES}?since={points['t'][-1]}")
        assert newer["points"]["t"] == [] and newer["events"] == []
        _, older = get(process, f"{SERIES}?since={points['t'][0]}")
        assert older["points"]["t"] == points["t"][1:]
    finally:
        process.stop()


def test_the_guard_state_names_what_the_model_does():
    from eva0_edge.runtime.server.series import guard_state

    x = uniform_batch(8)
    served = Policy.load(MODEL, "noadapt", provider="cpu", threads=1)
    served.step(x)
    assert guard_state(served) == "off"
    model = Policy.load(MODEL, "eva0", provider="cpu", threads=1)
    model.step(x)
    assert guard_state(model) == "adapting"
    model.freeze(True)
    assert guard_state(model) == "frozen"
    model.freeze(False)
    model.state.pause_left = 5  # a trip's pause: the adapted theta duels theta0
    assert guard_state(model) == "dueling"
    model.state.theta = model.metadata.theta0.copy()  # rolled back to theta0: nothing to duel
    assert guard_state(model) == "paused"
