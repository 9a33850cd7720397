"""Load benchmark of ``eva0-edge serve``: throughput and p50/p99 latency at several concurrencies.

    python -m eva0_edge.bench.serve_load --model models/resnet_gn_fmnist.onnx \\
        --concurrency 1,4,16 --methods noadapt,eva0 --out out/serve-load

For every method a real server process starts on a free loopback port; at each concurrency,
that many tritonclient.http clients (threads of this process) send ``--requests`` requests each
of ``--batch`` preprocessed images, back to back, after ``--warmup`` untimed ones (sent by
these clients before the load is timed and before the server's forward counter is read, with
either load generator: a budgeted server's bucket starts full, and at ``--budget 1.5`` the
first 1400 or so images spend it and refill it, so a steady-state measurement warms up past
them): one random image again and again, or with ``--stream CORRUPTION`` the Fashion-MNIST-C
test images of that corruption at severity 5 in order (the shifted stream adaptation is for;
the random image keeps the health guard in its pause). Latency is per request, client side
(send to parsed response); throughput is images per second of wall time. ``--delays
adaptive,fixed`` runs each method under both batching delays (the server's default, adaptive,
and ``--fixed-delay``). A method named ``eva0+async`` is served with ``--async-adapt``
(answers from one forward, adaptation on answered inputs while idle), one named ``METHOD@F``
with ``--budget F`` (``eva0+async@1.5``). The clients share the machine with the server: on
a 2-core machine they take CPU from it, so the numbers are for the whole client + server
system.
``--replicas 0,1,2`` repeats everything on the plain server (0) and on fleets of 1 and 2 Ray Serve
replicas (``serve --replicas N``, the [fleet] extra; ``--threads`` is then each replica's ORT
threads; the rows-per-step column is one replica's, from the ``/metrics`` that answered).
``--rounds N`` repeats the whole sweep N times, interleaved (a slow spell of a shared machine
then hits every method), each round starting one setting later than the one before (a
rotation: a fixed order can favour a position); the table shows medians over the rounds,
images/s, p50 and p99 also as the median of each round's ratio to NoAdapt's in the same setting,
and the forwards per sample the server counted over each load (``-`` for a fleet, whose
replicas count apart).
``--client perf_analyzer`` generates the load with Triton's perf_analyzer instead (one light
C++ process, ``make perf-analyzer``; ``--perf-analyzer PATH`` names another binary):
``--concurrency`` its concurrency range, ``requests x concurrency`` requests a measurement window
(``count_windows`` mode, up to 5 windows until three agree within 100%: a shared machine's
windows rarely agree within perf_analyzer's default 10%, and the rounds handle the noise), the
same rows as its ``--input-data``; throughput and p50 / p99 latency are perf_analyzer's, of its
last three windows.
Output: a table, ``serve_load.json`` (every round's rows) and ``serve_load.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

from .testbed.datasets import TEST_SEED, corrupted_fmnist
from .testbed.machine import environment
from .testbed.output import machine_line, pyplot, save_figure, write_outputs
from .testbed.workload import random_batch

CLIENTS = ("python", "perf_analyzer")
PERF_ANALYZER = Path(__file__).resolve().parents[1] / ".cache" / "perf-analyzer" / "perf_analyzer"
ASYNC = "+async"  # a method named eva0+async is served with --async-adapt
BUDGET = "@"  # eva0@1.5: served with --budget 1.5
RANDOM = "random"


def serve_options(method: str) -> tuple[str, tuple[str, ...]]:
    """(``serve --method`` value, more ``serve`` options) of a method label: ``eva0+async`` is
    served with ``--async-adapt``, ``eva0+async@1.5`` also with ``--budget 1.5``."""
    name, at, budget = method.partition(BUDGET)
    extra = ("--budget", str(float(budget))) if at else ()
    if name.endswith(ASYNC):
        return name.removesuffix(ASYNC), ("--async-adapt", *extra)
    return name, extra


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``eva0-edge serve`` (``replicas`` > 0: a fleet) in a subprocess on a free loopback port;
    ``extra``: more command-line options."""

    def __init__(
        self, model: str, method: str, threads: int | None, max_delay_ms: float, delay: str,
        replicas: int = 0, extra: tuple[str, ...] = (),
    ) -> None:
        self.port = _free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "eva0_edge.cli", "serve", "--model", model,
                   "--method", method, "--port", str(self.port),
                   "--max-delay-ms", str(max_delay_ms)]
        if delay == "fixed":
            command.append("--fixed-delay")
        if threads:
            command += ["--threads", str(threads)]
        if replicas:
            command += ["--replicas", str(replicas)]
        command += list(extra)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        client = httpclient.InferenceServerClient(self.url)
        wait_s = 600 if replicas else 120
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode(errors='replace')}")
            try:
                if client.is_server_ready():
                    client.close()
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
        raise RuntimeError(f"server not ready after {wait_s} s")

    def step_counts(self) -> tuple[float, float]:
        """(rows, steps) so far, from the server's Prometheus metrics."""
        with urllib.request.urlopen(f"http://{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        return tuple(
            float(re.search(rf"eva0_batch_rows_{key} (\S+)", text).group(1))
            for key in ("sum", "count")
        )

    def statistics(self, name: str) -> dict[str, Any]:
        """The served model's adaptation statistics (``GET .../adaptation/statistics``)."""
        url = f"http://{self.url}/v2/models/{name}/adaptation/statistics"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def forward_counts(self, name: str) -> tuple[int, int]:
        """(forwards, samples) the server's forward counter holds so far."""
        stats = self.statistics(name)
        return stats["forwards"], stats["samples"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()


def _load(url: str, name: str, images: np.ndarray, batch: int, clients: int, requests: int):
    """Every client sends ``requests`` batches of ``batch`` rows of ``images`` [N, C, H, W],
    the next rows each time (client i starts i x requests batches in, wrapping around); returns
    each request's latency (s) and the load's wall time (s)."""
    def run(client_index: int) -> list[float]:
        client = httpclient.InferenceServerClient(url)
        output = [httpclient.InferRequestedOutput("logits")]
        first = client_index * requests * batch

        def send(k: int) -> None:
            rows = np.arange(first + k * batch, first + (k + 1) * batch) % images.shape[0]
            tensor = httpclient.InferInput("pixel_values", [batch, *images.shape[1:]], "FP32")
            tensor.set_data_from_numpy(images[rows])
            client.infer(name, [tensor], outputs=output)

        try:
            latencies = []
            for k in range(requests):
                start = time.perf_counter()
                send(k)
                latencies.append(time.perf_counter() - start)
            return latencies
        finally:
            client.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = [t for part in pool.map(run, range(clients)) for t in part]
    return np.array(latencies), time.perf_counter() - start


def _python_measures(url: str, name: str, images: np.ndarray, batch: int, clients: int,
                     requests: int) -> dict[str, float]:
    """The Python clients' load (:func:`_load`): requests, images/s, p50 and p99 (ms)."""
    latencies, wall = _load(url, name, images, batch, clients, requests)
    return {"requests": int(latencies.size),
            "images_per_s": clients * requests * batch / wall,
            "p50_ms": 1000 * float(np.percentile(latencies, 50)),
            "p99_ms": 1000 * float(np.percentile(latencies, 99))}


def perf_analyzer_data(images: np.ndarray, path: Path) -> Path:
    """``images`` [N, C, H, W] as perf_analyzer's JSON input data: one row a step (a batched
    model's input shape has no batch dimension; ``-b`` makes the batches)."""
    path.write_text(json.dumps({"data": [
        {"pixel_values": {"content": row.ravel().tolist(), "shape": list(row.shape)}}
        for row in images]}))
    return path


def _perf_analyzer_measures(tool: Path, url: str, name: str, data: Path, batch: int,
                            clients: int, requests: int) -> dict[str, float]:
    """perf_analyzer's stable measurement at ``clients`` concurrency: requests, images/s, p50
    and p99 (ms), run as a Triton user runs it (no version named: it finds the one whose
    statistics grew)."""
    with tempfile.TemporaryDirectory() as folder:
        table = Path(folder) / "load.csv"
        command = [str(tool), "-m", name, "-u", url, "-i", "http", "-b", str(batch),
                   "--concurrency-range", str(clients), "--measurement-mode", "count_windows",
                   "--measurement-request-count", str(requests * clients), "--max-trials", "5",
                   "-s", "100", "--input-data", str(data), "-f", str(table)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if run.returncode != 0 or not table.is_file():
            raise RuntimeError(f"perf_analyzer failed ({run.returncode}): "
                               f"{(run.stdout + run.stderr)[-1500:]}")
        lines = table.read_text().strip().splitlines()
    header, values = lines[0].split(","), lines[1].split(",")
    row = dict(zip(header, values, strict=False))
    count = re.search(r"Client: \n\s+Request count: (\d+)", run.stdout)
    return {"requests": int(count[1]) if count else 0,
            "images_per_s": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1000.0,
            "p99_ms": float(row["p99 latency"]) / 1000.0}


def stream_images(metadata, stream: str, batch: int) -> np.ndarray:
    """The requests' rows [N, C, H, W]: ``random`` (one random image, ``batch`` rows, sent
    again and again: what a random-weight export can be loaded with) or a Fashion-MNIST-C
    corruption at severity 5 (the test split's images in order, preprocessed as the model
    expects: the shifted stream the product adapts on)."""
    if stream == RANDOM:
        return random_batch(metadata, batch)
    images, _ = corrupted_fmnist("test", stream, 5, TEST_SEED, progress=False)
    return preprocess_uint8(images, metadata.preprocessing)


def round_order(sweep: list[Any], rounds: int) -> list[tuple[int, Any]]:
    """(round, setting) in run order: round i runs ``sweep`` rotated by i, so that over
    ``len(sweep)`` rounds every setting runs once in every position. With a fixed order, in
    five rounds of sixteen clients with NoAdapt first, noadapt-shift (one forward and 30 us of
    NumPy per batch more) read 0.96x NoAdapt's images/s, and in four with the order reversed
    0.99x: a position effect or noise, either as large as a serving target's margin."""
    return [(i, sweep[(i + k) % len(sweep)]) for i in range(rounds) for k in range(len(sweep))]


def run_load(
    model: str, concurrency: list[int], methods: list[str], batch: int = 1, requests: int = 50,
    warmup: int = 3, threads: int | None = None, max_delay_ms: float = 10.0,
    delays: tuple[str, ...] = ("adaptive",), replicas: tuple[int, ...] = (0,),
    stream: str = RANDOM, rounds: int = 1, client: str = "python",
    perf_analyzer: Path = PERF_ANALYZER,
) -> dict[str, Any]:
    """Run every method under every delay mode ('adaptive', 'fixed') on every server (0: the
    plain one, N: a fleet of N replicas) at every concurrency, the whole sweep ``rounds`` times
    (interleaved, so a slow spell of a shared machine hits every method), the load from
    ``client`` ('python': threads of this process; 'perf_analyzer': that binary); returns the
    report dict (times in ms, one row per run)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r}: use {', '.join(CLIENTS)}")
    if client == "perf_analyzer" and not Path(perf_analyzer).is_file():
        raise ValueError(f"perf_analyzer not found at {perf_analyzer}: make perf-analyzer")
    unknown = set(delays) - {"adaptive", "fixed"}
    if unknown:
        raise ValueError(f"unknown delay mode(s) {sorted(unknown)}: use adaptive, fixed")
    metadata = read_metadata(model)
    images = stream_images(metadata, stream, batch)
    name = Path(model).stem
    data_dir = tempfile.TemporaryDirectory()
    data = perf_analyzer_data(images, Path(data_dir.name) / "data.json") \
        if client == "perf_analyzer" else None
    env_start = environment()
    rows = []
    sweep = [(m, d, n) for m in methods for d in delays for n in replicas]
    for round_index, (method, delay, fleet) in round_order(sweep, rounds):
        served_method, extra = serve_options(method)
        server = ServeProcess(model, served_method, threads, max_delay_ms, delay, fleet, extra)
        try:
            for clients in concurrency:
                if warmup:  # untimed, and before the counters are read
                    _load(server.url, name, images, batch, clients, warmup)
                rows_before, steps_before = server.step_counts()
                counted_before = None if fleet else server.forward_counts(name)
                if data is None:
                    measured = _python_measures(server.url, name, images, batch, clients,
                                                requests)
                else:
                    measured = _perf_analyzer_measures(Path(perf_analyzer), server.url, name,
                                                       data, batch, clients, requests)
                rows_after, steps_after = server.step_counts()
                steps = steps_after - steps_before
                forwards_per_sample = samples = None
                if counted_before is not None:  # a fleet's replicas count apart
                    forwards, samples = np.subtract(server.forward_counts(name), counted_before)
                    forwards_per_sample = float(forwards / samples)
                rows.append({
                    "round": round_index, "method": method, "delay": delay, "replicas": fleet,
                    "concurrency": clients, "batch": batch, **measured,
                    "steps": int(steps),
                    "rows_per_step": (rows_after - rows_before) / steps if steps else None,
                    "forwards_per_sample": forwards_per_sample,
                    "samples": None if samples is None else int(samples),
                })
                r = rows[-1]
                print(f"{method} ({delay}, replicas {fleet}) x{clients}: "
                      f"{r['images_per_s']:.1f} img/s, p50 "
                      f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
                      f"{_optional(forwards_per_sample)} forwards per sample", flush=True)
        finally:
            server.stop()
    data_dir.cleanup()
    return {
        "model": Path(model).name, "architecture": metadata.architecture,
        "threads": threads or "ort default", "max_delay_ms": max_delay_ms, "stream": stream,
        "rounds": rounds, "client": client,
        "environment_start": env_start, "environment_end": environment(), "rows": rows,
    }


MEASURES = ("images_per_s", "p50_ms", "p99_ms", "rows_per_step", "forwards_per_sample")


def summary(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (method, delay, replicas, concurrency) in run order: the median over the
    rounds of every measure, and the medians over rounds of images/s, p50 and p99 relative to
    NoAdapt's in the same round and setting (None without a NoAdapt run), with the lowest and
    highest of those per-round ratios (``..._range``)."""
    def setting(r: dict[str, Any]) -> tuple:
        return r.get("delay", "fixed"), r.get("replicas", 0), r["concurrency"], r["batch"]

    noadapt = {(r.get("round", 0), *setting(r)): r for r in report["rows"]
               if r["method"] == "noadapt"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in report["rows"]:
        groups.setdefault((r["method"], *setting(r)), []).append(r)
    out = []
    for (method, delay, replicas, clients, batch), runs in groups.items():
        row: dict[str, Any] = {"method": method, "delay": delay, "replicas": replicas,
                               "concurrency": clients, "batch": batch, "rounds": len(runs)}
        for key in MEASURES:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = float(np.median(values)) if values else None
        for key, name in (("images_per_s", "images_vs_noadapt"), ("p50_ms", "p50_vs_noadapt"),
                          ("p99_ms", "p99_vs_noadapt")):
            ratios = [r[key] / base[key] for r in runs
                      if (base := noadapt.get((r.get("round", 0), *setting(r))))]
            row[name] = float(np.median(ratios)) if ratios else None
            row[f"{name}_range"] = (min(ratios), max(ratios)) if ratios else None
        out.append(row)
    return out


def markdown(report: dict[str, Any]) -> str:
    rounds = report.get("rounds", 1)
    lines = [
        f"## Serve load: {report['architecture']} ({report['model']})",
        "",
        f"{machine_line(report)} Server max delay {report['max_delay_ms']} ms; the clients run "
        f"on the same machine. Requests: {stream_line(report.get('stream', RANDOM))}. "
        + (f"Medians over {rounds} interleaved rounds; x NoAdapt: the median of the per-round "
           "ratios to NoAdapt in the same setting (in brackets the lowest and the highest)."
           if rounds > 1 else ""),
        "",
        "| method | delay | replicas | clients | batch | images/s | x NoAdapt | p50 ms "
        "| x NoAdapt | p99 ms | x NoAdapt | rows per step | fwd/sample |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary(report):
        lines.append(
            f"| {r['method']} | {r['delay']} | {r['replicas'] or 'plain'} | "
            f"{r['concurrency']} | {r['batch']} | {r['images_per_s']:.1f} | "
            f"{_ratio(r, 'images_vs_noadapt', rounds)} | {r['p50_ms']:.1f} | "
            f"{_ratio(r, 'p50_vs_noadapt', rounds)} | {r['p99_ms']:.1f} | "
            f"{_ratio(r, 'p99_vs_noadapt', rounds)} | "
            f"{_optional(r['rows_per_step'])} | {_optional(r['forwards_per_sample'])} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(row: dict[str, Any], name: str, rounds: int) -> str:
    """A ratio cell: the median, and over several rounds the per-round range in brackets
    (a NoAdapt row, 1.00 in every round, stays plain)."""
    cell = _optional(row[name])
    spread = row.get(f"{name}_range")
    if rounds > 1 and spread is not None and spread[0] != spread[1]:
        cell += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    return cell


def _optional(value: float | None) -> str:
    """A table cell: the value to two decimals, or '-' where there is none."""
    return "-" if value is None else f"{value:.2f}"


def stream_line(stream: str) -> str:
    if stream == RANDOM:
        return "one random image, sent again and again"
    return f"the {stream} severity-5 test images in order, each client its own run of them"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    def label(r: dict[str, Any]) -> tuple[str, ...]:
        n = r.get("replicas", 0)
        return r["method"], r.get("delay", "fixed"), f"x{n}" if n else "plain"

    medians = summary(report)
    for method in dict.fromkeys(label(r) for r in medians):
        rows = [r for r in medians if label(r) == method]
        method = " ".join(method)
        c = [r["concurrency"] for r in rows]
        axes[0].plot(c, [r["images_per_s"] for r in rows], "o-", label=method)
        axes[1].plot(c, [r["p50_ms"] for r in rows], "o-", label=f"{method} p50")
        axes[1].plot(c, [r["p99_ms"] for r in rows], "s--", label=f"{method} p99")
    for ax, label in zip(axes, ("images / s", "latency ms"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"serve load: {report['architecture']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the model file to serve (required unless --report)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--methods", default="noadapt,eva0")
    parser.add_argument("--batch", type=int, default=1, help="images per request")
    parser.add_argument("--requests", type=int, default=50, help="timed requests per client")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per client, "
                        "sent before the load is timed and the server's counters read")
    parser.add_argument("--threads", type=int, help="server ORT threads")
    parser.add_argument("--max-delay-ms", type=float, default=10.0)
    parser.add_argument("--delays", default="adaptive",
                        help="batching delay modes, comma-separated: adaptive, fixed")
    parser.add_argument("--replicas", default="0", help="servers, comma-separated: 0 = the "
                        "plain server, N = a Ray Serve fleet of N replicas")
    parser.add_argument("--stream", default=RANDOM, help="what the requests carry: 'random' (one "
                        "random image) or a Fashion-MNIST-C corruption (severity 5 test images "
                        "in order; for the shipped Fashion-MNIST models)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole sweep this "
                        "many times, interleaved; the table shows medians")
    parser.add_argument("--client", default="python", choices=CLIENTS,
                        help="the load generator: threads of this process (python) or Triton's "
                        "perf_analyzer (make perf-analyzer)")
    parser.add_argument("--perf-analyzer", type=Path, default=PERF_ANALYZER,
                        help="the perf_analyzer binary (default: the one make perf-analyzer puts "
                        "in .cache/perf-analyzer)")
    parser.add_argument("--out", help="folder for serve_load.md / .json / .png")
    parser.add_argument("--report", type=Path, help="a serve_load.json to render again (table "
                        "and plot) instead of running; the run options are then ignored")
    args = parser.parse_args(argv)
    if args.report is not None:
        report = json.loads(args.report.read_text())
        print(markdown(report))
        if args.out:
            write_outputs(Path(args.out), "serve_load", report, markdown(report), plot)
        return
    if args.model is None:
        parser.error("--model is required (or --report)")
    report = run_load(
        args.model, [int(c) for c in args.concurrency.split(",")],
        [m.strip() for m in args.methods.split(",") if m.strip()], args.batch, args.requests,
        args.warmup, args.threads, args.max_delay_ms,
        tuple(d.strip() for d in args.delays.split(",") if d.strip()),
        tuple(int(n) for n in args.replicas.split(",")), args.stream, args.rounds,
        args.client, args.perf_analyzer,
    )
    print(markdown(report))
    if args.out:
        write_outputs(Path(args.out), "serve_load", report, markdown(report), plot)
        print(f"report: {args.out}/serve_load.md, serve_load.json, serve_load.png")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
