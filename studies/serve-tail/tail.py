"""Where the asynchronous server's one-client gap to NoAdapt comes from (issue 50 item 5):
perf_analyzer at one client against the shipped ResNet-GN (Gaussian-noise severity-5 test
images, ``--threads 1``), served by NoAdapt, ``eva0 --async-adapt --budget 1.5`` and ``eva0
--async-adapt --budget 1`` (the one-forward tier: no pass ever runs), interleaved rounds; in
each server the worker's calls are timed (``probe/sitecustomize.py``: ``step`` is NoAdapt's
whole batch, ``serve_step`` the asynchronous answer, ``learn`` a block's learning,
``begin_pass`` / ``_finish_pass`` a pass's two ends on the worker).

    python studies/serve-tail/tail.py --out results/serve-tail --rounds 3

``--clients N`` loads the servers with N concurrent requests instead of one, and ``--warmup W``
sends W untimed requests per client first (a budgeted server's bucket starts full: at budget
1.5 the first 1400 or so images spend and refill it), whose worker calls are left out; the
``busy`` column is the worker's timed calls' seconds over the load's wall time. ``--threads
T`` serves with T ORT intra-op threads (default 1; 0: ORT's default, one per core).

``--code NAME=PATH`` (repeatable) serves the asynchronous servers from each named source tree
too (``PATH`` a folder holding an ``eva0_edge`` package, put first on ``PYTHONPATH``; NoAdapt
from the installed one), interleaved with the rest; ``--servers`` picks the servers by label.
Writes ``tail.md`` and ``tail.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from eva0_edge.bench import serve_load
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.runtime.modelfile import read_metadata

MODEL = "models/resnet_gn_fmnist.onnx"
SERVERS = (("noadapt", "noadapt", ()),
           ("async@1.5", "eva0", ("--async-adapt", "--budget", "1.5")),
           ("async@1", "eva0", ("--async-adapt", "--budget", "1")))
PROBE = Path(__file__).resolve().parent / "probe"


def _probe_calls(folder: Path) -> dict[str, list[float]]:
    """The probe's last write: every timed call's seconds, by call."""
    time.sleep(2.5)  # the probe writes every 2 s
    (probe,) = folder.glob("*.json")
    return json.loads(probe.read_text())


def one_run(label: str, method: str, extra: tuple[str, ...], code: str, data: Path,
            requests: int, folder: Path, clients: int, warmup: int,
            images: np.ndarray, threads: int) -> dict:
    """perf_analyzer's measurement of one server (its package from ``code``, a folder, or the
    installed one when empty) at ``clients`` concurrency after ``warmup`` untimed requests per
    client, and its worker's call times (ms) during the measurement; ``threads``: the server's
    ORT intra-op threads (0: ORT's default)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["EVA0_PROBE_OUT"] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (code, str(PROBE)) if p)
    server = serve_load.ServeProcess(MODEL, method, threads or None, 10.0, "adaptive", 0, extra)
    try:
        if warmup:
            serve_load._load(server.url, Path(MODEL).stem, images, 1, clients, warmup)
        before = {name: len(s) for name, s in _probe_calls(folder).items()} if warmup else {}
        start = time.perf_counter()
        row = serve_load._perf_analyzer_measures(serve_load.PERF_ANALYZER, server.url,
                                                 Path(MODEL).stem, data, 1, clients, requests)
        wall = time.perf_counter() - start
        timed = {name: s[before.get(name, 0):] for name, s in _probe_calls(folder).items()}
    finally:
        server.stop()
    calls = {name: {"calls": len(s), "mean_ms": 1e3 * float(np.mean(s)),
                    "p99_ms": 1e3 * float(np.percentile(s, 99)), "total_s": float(np.sum(s))}
             for name, s in timed.items() if s}
    busy = sum(c["total_s"] for c in calls.values()) / wall
    return {"server": label, **row, "load": os.getloadavg()[0], "busy": busy, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--code", action="append", default=[], help="NAME=PATH, repeatable")
    parser.add_argument("--servers", default=",".join(label for label, _, _ in SERVERS))
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0, help="untimed requests per client")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, 0: default")
    args = parser.parse_args()
    codes = [tuple(c.split("=", 1)) for c in args.code] or [("", "")]
    chosen = args.servers.split(",")
    sweep = [(label + (f"/{name}" if name and method != "noadapt" else ""), method, extra,
              path if method != "noadapt" else "")
             for label, method, extra in SERVERS if label in chosen
             for name, path in (codes if method != "noadapt" else codes[:1])]
    images = serve_load.stream_images(read_metadata(MODEL), "gaussian_noise", 1)[:2000]
    data = serve_load.perf_analyzer_data(images, Path(tempfile.mkdtemp()) / "data.json")
    report = {"environment_start": environment(), "rows": []}
    for round_, server in serve_load.round_order(sweep, args.rounds):
        folder = args.out / "probes" / f"{server[0].replace('/', '-')}-{round_}"
        row = one_run(*server, data, args.requests, folder, args.clients, args.warmup, images,
                      args.threads)
        report["rows"].append({"round": round_, **row})
        print(json.dumps(report["rows"][-1]), flush=True)
    report["environment_end"] = environment()
    lines = ["| round | server | images/s | x NoAdapt | p50 ms | p99 ms | busy | worker call: "
             "mean ms (calls) |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        base = next(r for r in report["rows"]
                    if r["round"] == row["round"] and r["server"] == "noadapt")
        calls = ", ".join(f"{n} {c['mean_ms']:.3f} ({c['calls']})"
                          for n, c in row["calls"].items() if n != "learn" or c["total_s"] > 0.05)
        lines.append(f"| {row['round']} | {row['server']} | {row['images_per_s']:.0f} | "
                     f"{row['images_per_s'] / base['images_per_s']:.2f} | {row['p50_ms']:.2f} | "
                     f"{row['p99_ms']:.2f} | {row['busy']:.2f} | {calls} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tail.md").write_text("\n".join(lines) + "\n")
    (args.out / "tail.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
