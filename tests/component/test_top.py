"""``eva0-edge top --once`` against an in-process server: one frame of the series, its latest
numbers the statistics route's, and the errors an operator meets spelled out."""

from __future__ import annotations

import json
import time

import pytest

from eva0_edge.cli import main
from eva0_edge.runtime.top import ROWS, SPARKS, SeriesView, fmt, sparkline
from tests.component.test_dashboard_routes import SERIES, STATISTICS, infer, serve
from tests.fixtures import NAME, http_call, uniform_batch


@pytest.fixture(scope="module")
def server():
    process = serve(budget=1.5, bank_slots=4)
    x = uniform_batch(160, seed=5)
    for i in range(0, 160, 4):
        infer(process, x[i : i + 4])
    time.sleep(1.1)  # over the series' interval: top's read closes a point after the stream
    yield process
    process.stop()


def frame_values(text: str) -> dict[tuple[str, str], str]:
    """{(label, unit): latest} of the frame's table rows."""
    values = {}
    for label, unit in {(label, unit) for _, label, unit, _ in ROWS}:
        (line,) = [line for line in text.splitlines()
                   if line.startswith(label + " ") and f" {unit} " in line]
        values[label, unit] = line.split(f" {unit} ", 1)[1].split()[0]
    return values


def test_one_frame_shows_what_the_statistics_report(server, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["top", "--url", f"http://127.0.0.1:{server.port}/", "--once"]) == 0
    text = capsys.readouterr().out
    stats = json.loads(http_call(server, "GET", STATISTICS)[1])
    shown = frame_values(text)
    guard = stats["guard"]
    expected = {
        ("forwards/sample", "since start"): stats["forwards_per_sample"],
        ("budget credit", "share"): stats["budget"]["fill"],
        ("drift", "||theta - theta0||"): stats["drift"],
        ("entropy", "guard window / ln K"): guard["signals"]["entropy"],
        ("alignment", "to the source"): guard["signals"]["alignment"],
        ("input changes", "count"): stats["input_changes"],
        ("shift changes", "count"): stats["activation_shift"]["stream_changes"],
        ("bank hits", "count"): stats["bank"]["hits"],
        ("guard trips", "count"): guard["trips"],
    }
    for key, value in expected.items():
        assert shown[key] == fmt(value), (key, shown[key], value)
    assert f"top {NAME}" in text and "<= 1.5" in text  # the budget's line
    assert f"({stats['samples']} samples" in text


def test_behind_a_load_balancer_each_replica_has_its_columns(capsys):
    """Answers of two named replicas, each asked ``since`` the view's oldest newest point: the
    frame names the replica that answered last and shows each one's own latest numbers, and
    an answer read twice adds no point."""
    from rich.console import Console

    replicas = {"a": serve(replica="a", budget=1.5), "b": serve(replica="b", budget=1.5)}
    try:
        x = uniform_batch(16, seed=6)
        infer(replicas["a"], x[:4])
        infer(replicas["b"], x)
        time.sleep(1.1)  # over the series' interval: the reads below close a point
        view = SeriesView(history=60)
        for name in ("a", "b", "b", "a"):
            since = view.since()
            query = "" if since is None else f"?since={since!r}"
            view.merge(json.loads(http_call(replicas[name], "GET", SERIES + query)[1]))
        stats = {n: json.loads(http_call(p, "GET", STATISTICS)[1]) for n, p in replicas.items()}
        for name, process in replicas.items():
            own = json.loads(http_call(process, "GET", SERIES)[1])["points"]
            held = list(view.replicas[name]["t"])
            assert held == [t for t in own["t"] if held[0] <= t <= held[-1]], name
            assert view.latest("samples", name) == stats[name]["samples"]
        assert stats["a"]["samples"] == 4 and stats["b"]["samples"] == 16
        console = Console(width=200, color_system=None)
        with console.capture() as capture:
            console.print(view.frame())
        text = capture.get()
        assert "replica: a" in text and "replicas: a adapting b adapting" in text, text
        (line,) = [line for line in text.splitlines() if line.startswith("drift ")]
        values = line.split("||theta - theta0||", 1)[1].split()
        shown = [v for v in values if not set(v) <= set(SPARKS)]
        assert shown[:2] == [fmt(stats["a"]["drift"]), fmt(stats["b"]["drift"])], line
    finally:
        for process in replicas.values():
            process.stop()


def test_the_model_is_named_or_found(server, capsys):
    url = f"http://127.0.0.1:{server.port}"
    assert main(["top", "--url", url, "--model", NAME, "--once"]) == 0
    assert main(["top", "--url", url, "--model", "other", "--once"]) == 2
    assert "HTTP 404 unknown model 'other'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--url", "ftp://host"], "--url must be http://HOST:PORT"),
    (["--url", "http://127.0.0.1:1"], "no answer"),
    (["--url", "http://127.0.0.1:1", "--interval", "0"], "--interval must be"),
    (["--url", "http://127.0.0.1:1", "--interval", "nan"], "--interval must be"),
])
def test_bad_arguments_and_no_server_are_clear_errors(args, message, capsys):
    assert main(["top", *args, "--once"]) == 2
    assert message in capsys.readouterr().err


def test_a_sparkline_scales_to_its_range_and_skips_gaps():
    assert sparkline([0.0, 1.0, None, 0.5]) == "\u2581\u2588 \u2585"
    assert sparkline([2.0, 2.0]) == "\u2581\u2581" and sparkline([None]) == " "
