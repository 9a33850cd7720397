"""How long a server takes to exit after SIGTERM on a starved host (issue 50 item 7).

The issue's setting: two CPU-bound processes in the server's own scheduling group (children of
this script, as processes of one container share its cgroup), ``--threads 1``, clients sending
one image per request until the signal. Per model and mode (synchronous, ``--async-adapt``),
``--trials`` servers: each serves for ``--serve-s`` seconds under the hogs, gets SIGTERM with
requests in flight, and is timed to its exit; the newest snapshot is then checked (written
after the signal, it verifies and loads) and the log read for an abandoned pass.

    python studies/serve-shutdown/shutdown.py --out results/serve-shutdown --trials 5

``--code NAME=PATH`` (repeatable) serves from each named source tree too (``PATH`` a folder
holding an ``eva0_edge`` package, put first on the servers' ``PYTHONPATH``; the installed one
is ``head``), interleaved with the rest. Writes ``shutdown.md``, ``shutdown.json`` and
``shutdown.png``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from eva0_edge.bench.serve_load import ServeProcess, stream_images
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import pyplot, save_figure, write_outputs
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.state import decode_state

MODELS = ("models/resnet_gn_fmnist.onnx", "models/vit_fmnist.onnx")
MODES = {"sync": (), "async": ("--async-adapt",)}
HOG = "while True: pass"


def _clients(url: str, name: str, images: np.ndarray, count: int,
             stop: threading.Event) -> list[threading.Thread]:
    """``count`` threads sending one image per request until ``stop`` (errors end a thread:
    the server is going away)."""
    def run(index: int) -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=120)
        k = index
        try:
            while not stop.is_set():
                tensor = httpclient.InferInput("pixel_values", [1, *images.shape[1:]], "FP32")
                tensor.set_data_from_numpy(images[k % len(images)][None])
                client.infer(name, [tensor])
                k += count
        except Exception:  # noqa: BLE001 - the server stopped under the request
            return
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def one_trial(model: str, mode: str, code: str, serve_s: float, clients: int,
              hogs: int) -> dict[str, Any]:
    """One server's (its package from ``code``, a folder, or the installed one when empty)
    SIGTERM-to-exit time (s) under ``hogs`` CPU-bound processes, and what it left in its state
    directory."""
    name = Path(model).stem
    images = stream_images(read_metadata(model), "gaussian_noise", 1)[:512]
    state_dir = Path(tempfile.mkdtemp(prefix="shutdown-"))
    saved = os.environ.get("PYTHONPATH")
    if code:
        os.environ["PYTHONPATH"] = code
    try:
        server = ServeProcess(model, "eva0", 1, 5.0, "adaptive", extra=(
            *MODES[mode], "--state-dir", str(state_dir), "--snapshot-every", "20"))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    stop = threading.Event()
    hog_processes = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        threads = _clients(server.url, name, images, clients, stop)
        time.sleep(serve_s)
        signalled = time.time()
        start = time.perf_counter()
        server.process.send_signal(signal.SIGTERM)
        status = server.process.wait(300)
        exit_s = time.perf_counter() - start
    finally:
        stop.set()
        for hog in hog_processes:
            hog.kill()
            hog.wait()
    for thread in threads:
        thread.join(30)
    server.log.seek(0)
    log = server.log.read().decode(errors="replace")
    server.log.close()
    snapshots = sorted(state_dir.glob("snapshot-*.npz"))
    newest = snapshots[-1] if snapshots else None
    written = newest is not None and newest.stat().st_mtime >= signalled
    step = decode_state(newest.read_bytes())[0].step if newest is not None else None
    return {"model": name, "mode": mode, "exit_s": exit_s, "exit_status": status,
            "snapshot_after_signal": written, "snapshot_step": step,
            "abandoned_pass": "is abandoned" in log}


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [f"{report['hogs']} CPU-bound processes beside the server (`--threads 1`), "
             f"{report['clients']} clients of one image per request, SIGTERM after "
             f"{report['serve_s']:g} s of serving; load average at the start "
             f"{report['environment_start']['load_average'][0]:.2f}, at the end "
             f"{report['environment_end']['load_average'][0]:.2f}. Codes: "
             + ", ".join(f"`{name}` {path or 'the installed package'}"
                         for name, path in report["codes"].items())
             + f". Exit statuses: {sorted({r['exit_status'] for r in rows})} (-15: uvicorn "
             "ends the process by the signal it caught, once the app has stopped).", "",
             "| model | mode | code | trials | exit s: median (min-max) | snapshot after the "
             "signal | pass abandoned | steps in it: median |", "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in MODES:
            for code in dict.fromkeys(r["code"] for r in rows):
                part = [r for r in rows
                        if r["model"] == model and r["mode"] == mode and r["code"] == code]
                if not part:
                    continue
                times = [r["exit_s"] for r in part]
                steps = [r["snapshot_step"] for r in part if r["snapshot_step"] is not None]
                lines.append(
                    f"| {model} | {mode} | {code} | {len(part)} | {np.median(times):.2f} "
                    f"({min(times):.2f}-{max(times):.2f}) | "
                    f"{sum(r['snapshot_after_signal'] for r in part)} | "
                    f"{sum(r['abandoned_pass'] for r in part)} | "
                    f"{np.median(steps) if steps else '-'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['model']} {r['mode']} {r['code']}" for r in report["rows"]]
    order = list(dict.fromkeys(labels))
    for i, label in enumerate(order):
        times = [r["exit_s"] for r, lab in zip(report["rows"], labels, strict=True)
                 if lab == label]
        ax.scatter([i] * len(times), times, color="C0")
    ax.axhline(10, color="C3", linestyle="--", label="the issue's 10 s")
    ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("SIGTERM to exit (s)")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--serve-s", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--code", action="append", default=[], help="NAME=PATH")
    args = parser.parse_args()
    codes = [("head", ""), *(tuple(c.split("=", 1)) for c in args.code)]
    report: dict[str, Any] = {"environment_start": environment(), "trials": args.trials,
                              "serve_s": args.serve_s, "clients": args.clients,
                              "hogs": args.hogs, "codes": dict(codes), "rows": []}
    for trial in range(args.trials):  # interleaved: every cell once per trial
        for model in MODELS:
            for mode in MODES:
                for code, path in codes:
                    row = one_trial(model, mode, path, args.serve_s, args.clients, args.hogs)
                    report["rows"].append({"trial": trial, "code": code, **row})
                print(row, flush=True)
    report["environment_end"] = environment()
    write_outputs(args.out, "shutdown", report, markdown(report), plot)
    print(markdown(report))


if __name__ == "__main__":
    main()
