"""Does merging help a fleet? The continual corrupted stream (15 corruptions in a row, severity
5) sent one image per request to a fleet of N replicas (``serve --replicas N``), with merged
adaptation (``--combine``: the merge rules to compare) and without (``--sync-every-s 0``),
against NoAdapt and one process fed the same stream at batch ``--batch`` (``eva0-edge eval
--protocol continual``).

    python studies/fleet-stream/fleet_stream.py --model models/resnet_gn_fmnist.onnx \\
        --replicas 4 --limit 300 --out out/fleet-stream

``--clients`` concurrent clients take the stream's images in order (each sends the next
unsent image), so consecutive images reach different replicas as Ray Serve's router spreads
them; served accuracy is counted per domain. Output: a table, ``fleet_stream.json`` and
``fleet_stream.png`` (per-domain accuracy).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.bench.serve_load import ServeProcess
from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import machine_line, pyplot, save_figure, write_outputs
from eva0_edge.bench.testbed.streams import continual_stream, per_domain, serve_stream
from eva0_edge.runtime.session import SessionSettings


def run(model: str, replicas: int, limit: int, batch: int, clients: int, sync_every_s: float,
        threads: int, combines: tuple[str, ...] = ("mean",), seed: int = 0) -> dict[str, Any]:
    spec = EvalSpec(model=model, dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=batch, methods=["noadapt", "eva0"], limit=limit, seed=seed,
                    session=SessionSettings(threads=threads))
    env_start = environment()
    local = evaluate(spec, progress=False)
    rows = {f"{m} (one process, B={batch})": r.accuracy for m, r in local.items()}
    names, x, y = continual_stream(spec)
    runs = [(f"eva0 fleet x{replicas}, {c} merged every {sync_every_s:g} s", sync_every_s, c)
            for c in combines]
    runs.append((f"eva0 fleet x{replicas}, no merging", 0.0, "sum"))
    for label, every, combine in runs:
        server = ServeProcess(model, "eva0", threads, 10.0, "adaptive", replicas,
                              ("--sync-every-s", str(every), "--fleet-combine", combine))
        try:
            predicted = serve_stream(server.url, Path(model).stem, x, clients)
        finally:
            server.stop()
        rows[label] = per_domain(names, predicted == y)
        print(f"{label}: {np.mean(list(rows[label].values())):.2f}", flush=True)
    return {
        "model": Path(model).name, "replicas": replicas, "limit": limit, "batch": batch,
        "clients": clients, "sync_every_s": sync_every_s, "threads": threads,
        "environment_start": env_start, "environment_end": environment(),
        "accuracy": rows,
        "average": {k: float(np.mean(list(v.values()))) for k, v in rows.items()},
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Fleet on the continual stream: {report['model']}, {report['replicas']} replicas",
        "",
        f"{machine_line(report)} Severity 5, {report['limit']} test images per corruption, one "
        f"image per request from {report['clients']} clients.",
        "",
        "| run | mean accuracy (%) |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["average"].items()]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    for label, accuracy in report["accuracy"].items():
        ax.plot(list(accuracy), list(accuracy.values()), "o-", label=label)
    ax.set_ylabel("accuracy (%)")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=8)
    fig.suptitle(f"fleet on the continual stream: {report['model']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--limit", type=int, default=300, help="images per corruption")
    parser.add_argument("--batch", type=int, default=16, help="the one process's batch")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sync-every-s", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--combine", default="mean", help="merge rules to run, comma-separated: "
                        "sum, mean (serve --fleet-combine)")
    parser.add_argument("--out", help="folder for fleet_stream.md / .json / .png")
    args = parser.parse_args(argv)
    report = run(args.model, args.replicas, args.limit, args.batch, args.clients,
                 args.sync_every_s, args.threads, tuple(args.combine.split(",")))
    print(markdown(report))
    if args.out:
        write_outputs(Path(args.out), "fleet_stream", report, markdown(report), plot)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
