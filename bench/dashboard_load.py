"""How fast the operator's view answers while the server is loaded: ``GET /dashboard``, its
files, and the series route (the whole ring and ``?since=`` the newest point), each as a
ratio to the health route timed the same way at the same time.

    python -m eva0_edge.bench.dashboard_load --model models/resnet_gn_fmnist.onnx \\
        --clients 16 --requests 400 --out results/dashboard

A real server process (``serve --threads 1 --budget 1.5``) starts on a free loopback port;
``--clients`` tritonclient.http clients (threads of this process) send ``--requests`` requests
of one Fashion-MNIST test image each, back to back, while one prober sends the routes below
in turn (rotated each round, one connection per route kept open), timing each answer from
request to the last byte read. It probes idle for ``--idle-rounds`` first, then for as long as
the load runs. The table gives each route's p50 / p99 (ms) and their ratios to the health
route's under load. A server up for an hour answers the whole ring (3600 points); a short run
holds fewer, so the ring's full answer is also timed in this process (building a full ring's
JSON, the route's work on the event loop besides the request itself).
Output: a table, ``dashboard_load.json`` and ``dashboard_load.png``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.bench.serve_load import ServeProcess, _load
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

HEALTH = "/v2/health/ready"


def routes(name: str) -> dict[str, str]:
    """The probed routes by label (``series since`` is filled in per probe)."""
    series = f"/v2/models/{name}/adaptation/series"
    return {"health": HEALTH, "dashboard page": "/dashboard",
            "dashboard.js": "/dashboard/dashboard.js", "uPlot": "/dashboard/uPlot.iife.min.js",
            "series (all)": series, "series since": series + "?since={since}"}


class Prober:
    """Times each route in turn on a connection of its own, one request at a time."""

    def __init__(self, port: int, name: str) -> None:
        self.port = port
        self.paths = routes(name)
        self.connections = {label: http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                            for label in self.paths}
        self.since = 0.0

    def probe(self, label: str) -> float:
        """Seconds from sending ``label``'s request to its last byte."""
        path = self.paths[label].format(since=repr(self.since))
        conn = self.connections[label]
        start = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        seconds = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:300]!r}")
        if label == "series (all)":
            self.since = json.loads(body)["points"]["t"][-1]
        return seconds

    def rounds(self, count: int | None, stop: threading.Event | None = None,
               pause_s: float = 0.02) -> dict[str, list[float]]:
        """``count`` rounds (or until ``stop``), every route once a round, the order rotated."""
        labels = list(self.paths)
        times: dict[str, list[float]] = {label: [] for label in labels}
        done = 0
        while (count is None or done < count) and not (stop is not None and stop.is_set()):
            shift = done % len(labels)
            for label in labels[shift:] + labels[:shift]:
                times[label].append(self.probe(label))
            done += 1
            time.sleep(pause_s)
        return times

    def close(self) -> None:
        for conn in self.connections.values():
            conn.close()


def full_ring_seconds(repeats: int = 20) -> dict[str, float]:
    """Building a full default ring's answer (points and JSON) in this process: p50 / p99
    seconds, and its size in bytes."""
    from eva0_edge.runtime.server.series import FIELDS, GUARD_STATES, AdaptationSeries

    clock = [0.0]
    series = AdaptationSeries(clock=lambda: clock[0])
    reading = {name: 1.2345678901 for name in FIELDS if name not in (
        "t", "seconds", "requests", "images", "images_per_s", "latency_p50_ms",
        "latency_p99_ms", "forwards_per_sample_interval", "guard_states_seen")}
    reading["guard_state"] = 0.0
    for i in range(series.capacity):
        series.record_request(0.01, 1)
        clock[0] += 1.0
        series.add({**reading, "steps": float(i), "samples": float(i), "forwards": 1.5 * i})
    times, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        body = json.dumps({"points": series.points_since(), "events": series.events_since(),
                           "guard_states": list(GUARD_STATES)}).encode()
        times.append(time.perf_counter() - start)
        size = len(body)
    return {"p50_ms": 1000 * float(np.median(times)),
            "p99_ms": 1000 * float(np.percentile(times, 99)), "bytes": size}


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    rows = {label: {"count": len(t), "p50_ms": 1000 * float(np.percentile(t, 50)),
                    "p99_ms": 1000 * float(np.percentile(t, 99))} for label, t in times.items()}
    health = rows["health"]
    for row in rows.values():
        row["p50_ratio"] = row["p50_ms"] / health["p50_ms"]
        row["p99_ratio"] = row["p99_ms"] / health["p99_ms"]
    return rows


def markdown(report: dict[str, Any]) -> str:
    load = report["load"]
    lines = [
        f"{report['clients']} clients x {report['requests']} requests of one image "
        f"({load['images_per_s']:.0f} images/s, their p50 {load['p50_ms']:.1f} ms, p99 "
        f"{load['p99_ms']:.1f} ms); load average {report['loadavg']}",
        "",
        "| route | idle p50 ms | loaded p50 ms | loaded p99 ms | p50 / health | p99 / health "
        "| probes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in report["loaded"].items():
        idle = report["idle"][label]
        lines.append(f"| {label} | {idle['p50_ms']:.2f} | {row['p50_ms']:.2f} | "
                     f"{row['p99_ms']:.2f} | {row['p50_ratio']:.2f} | {row['p99_ratio']:.2f} | "
                     f"{row['count']} |")
    ring = report["full_ring_in_process"]
    lines += ["", f"A full ring's answer ({ring['bytes'] / 1024:.0f} KiB of JSON) is built in "
              f"{ring['p50_ms']:.1f} ms (p99 {ring['p99_ms']:.1f} ms) in this process, idle."]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["loaded"])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for offset, (key, colour) in zip((-0.2, 0.2), (("p50_ms", "#1565c0"), ("p99_ms", "#c62828")),
                                     strict=True):
        ax.bar(x + offset, [report["loaded"][label][key] for label in labels], 0.4,
               label=f"{key[:3]} under load", color=colour)
    ax.axhline(100, color="#9e9e9e", linestyle="--", label="target 100 ms")
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"The operator's view under {report['clients']} clients")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=400, help="per client")
    p.add_argument("--idle-rounds", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.idle_rounds < 1:
        p.error("--clients, --requests and --idle-rounds must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = read_metadata(args.model)
    images = preprocess_uint8(load_fashion_mnist("test")[0][:1000], metadata.preprocessing)
    name = Path(args.model).stem
    server = ServeProcess(args.model, "eva0", 1, 10.0, "adaptive", extra=("--budget", "1.5"))
    prober = Prober(server.port, name)
    try:
        time.sleep(1.1)  # a first point in the ring
        idle = prober.rounds(args.idle_rounds)
        stop = threading.Event()
        loaded: dict[str, list[float]] = {}
        thread = threading.Thread(target=lambda: loaded.update(prober.rounds(None, stop)))
        thread.start()
        latencies, wall = _load(server.url, name, images, 1, args.clients, args.requests, 5)
        stop.set()
        thread.join()
    finally:
        prober.close()
        server.stop()
    report = {
        "model": args.model, "clients": args.clients, "requests": args.requests,
        "loadavg": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "load": {"images_per_s": args.clients * (args.requests + 5) / wall,
                 "p50_ms": 1000 * float(np.percentile(latencies, 50)),
                 "p99_ms": 1000 * float(np.percentile(latencies, 99))},
        "idle": summary(idle), "loaded": summary(loaded),
        "full_ring_in_process": full_ring_seconds(),
    }
    (out / "dashboard_load.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "dashboard_load.md").write_text(text + "\n")
    plot(report, out / "dashboard_load.png")
    print(text)


if __name__ == "__main__":
    main()
