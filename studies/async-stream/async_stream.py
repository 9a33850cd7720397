"""Asynchronous against synchronous serving on the continual stream: served accuracy and the
forwards per sample the server counted.

    python studies/async-stream/async_stream.py --model models/resnet_gn_fmnist.onnx \\
        --limit 300 --budgets full,2 --out out/async-stream

The continual corrupted stream (15 corruptions in a row, severity 5, ``--limit`` test images
each) goes one image per request from ``--clients`` clients to ``eva0-edge serve``: NoAdapt,
EVA-0 as it is (each batch answered by its own step), and EVA-0 with ``--async-adapt`` (answered
from one forward, adapted on while the worker is idle) at each of ``--budgets`` (``full``: no
budget; a number: ``--budget F``, forwards per sample). Each run reports its served accuracy,
the server's forward counter and, asynchronous, the samples adapted on and dropped. Output: a
table, ``async_stream.json`` and ``async_stream.png``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.bench.serve_load import ServeProcess
from eva0_edge.bench.testbed.evaluate import EvalSpec
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import machine_line, pyplot, save_figure, write_outputs
from eva0_edge.bench.testbed.streams import continual_stream, per_domain, serve_stream
from eva0_edge.runtime.session import SessionSettings


def runs(budgets: list[str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, method, serve options) of every run: NoAdapt, synchronous EVA-0, then the
    asynchronous one at each budget."""
    out = [("noadapt", "noadapt", ()), ("eva0 synchronous", "eva0", ())]
    for budget in budgets:
        extra = ("--async-adapt",) + (() if budget == "full" else ("--budget", budget))
        out.append((f"eva0 asynchronous, budget {budget}", "eva0", extra))
    return out


def run(model: str, limit: int, clients: int, budgets: list[str], threads: int,
        seed: int = 0) -> dict[str, Any]:
    spec = EvalSpec(model=model, dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=1, methods=["noadapt"], limit=limit, seed=seed,
                    session=SessionSettings(threads=threads))
    names, x, y = continual_stream(spec)
    name = Path(model).stem
    env_start = environment()
    rows = []
    for label, method, extra in runs(budgets):
        server = ServeProcess(model, method, threads, 10.0, "adaptive", 0, extra)
        try:
            predicted = serve_stream(server.url, name, x, clients)
            stats = server.statistics(name)
        finally:
            server.stop()
        accuracy = per_domain(names, predicted == y)
        rows.append({"run": label, "average": float(np.mean(list(accuracy.values()))),
                     "forwards_per_sample": stats["forwards_per_sample"],
                     "asynchronous": stats.get("asynchronous"), "accuracy": accuracy})
        print(f"{label}: {rows[-1]['average']:.2f}% at "
              f"{rows[-1]['forwards_per_sample']:.2f} forwards per sample", flush=True)
    return {"model": Path(model).name, "limit": limit, "clients": clients, "threads": threads,
            "environment_start": env_start, "environment_end": environment(), "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Asynchronous serving on the continual stream: {report['model']}", "",
        f"{machine_line(report)} Severity 5, {report['limit']} test images per corruption, one "
        f"image per request from {report['clients']} client(s).", "",
        "| run | accuracy (%) | fwd/sample | adapted / served |", "|---|---|---|---|",
    ]
    for r in report["rows"]:
        counts = r["asynchronous"]
        share = (f"{counts['adapted_samples']} / {counts['served_samples']}" if counts else "-")
        lines.append(f"| {r['run']} | {r['average']:.2f} | {r['forwards_per_sample']:.2f} | "
                     f"{share} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["rows"]:
        ax.scatter(r["forwards_per_sample"], r["average"])
        ax.annotate(r["run"], (r["forwards_per_sample"], r["average"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("forwards per sample (the server's counter)")
    ax.set_ylabel("served accuracy % (continual)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"asynchronous serving: {report['model']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=300, help="images per corruption")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--budgets", default="full,2",
                        help="asynchronous runs, comma-separated: full (no budget) or F")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="folder for async_stream.md / .json / .png")
    args = parser.parse_args(argv)
    report = run(args.model, args.limit, args.clients,
                 [b.strip() for b in args.budgets.split(",") if b.strip()], args.threads)
    print(markdown(report))
    if args.out:
        write_outputs(Path(args.out), "async_stream", report, markdown(report), plot)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
