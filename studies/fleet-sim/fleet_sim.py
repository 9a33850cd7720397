"""The fleet's merge rule without Ray or HTTP: the continual corrupted stream dealt round robin
to N in-process replicas (real :class:`~eva0_edge.runtime.policy.Policy` s, one image each per
step by default), which report to a real :class:`~eva0_edge.fleet.state_actor.FleetState`
every ``--every`` images of their own and apply what it answers, as ``serve --replicas N``
does; against one process fed the whole stream and the same replicas without merging.
Deterministic (no timing, no router), so merge rules and windows can be compared over seeds in
seconds.

    python studies/fleet-sim/fleet_sim.py --model models/resnet_gn_fmnist.onnx --limit 400 \\
        --replicas 4 --every 0,25 --seeds 1,2 --out out/fleet-sim

Every fleet run divides the model's activation-shift window among the replicas as the served
fleet does (:func:`eva0_edge.fleet.serve.shared_stream_config`); ``--undivided`` keeps it whole.
Output: a table (mean accuracy over the 15 corruptions, per seed and on average),
``fleet_sim.json`` and ``fleet_sim.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.bench.testbed.evaluate import EvalSpec
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import machine_line, write_outputs
from eva0_edge.bench.testbed.streams import continual_stream, per_domain
from eva0_edge.fleet.serve import shared_stream_config
from eva0_edge.fleet.state_actor import FleetConfig, FleetState
from eva0_edge.fleet.sync import FleetSync, InlineWorker, local_actor
from eva0_edge.runtime.config import parse_key_values
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import SessionSettings


def one_process(model: str, method: str, config: dict[str, Any], x: np.ndarray, batch: int,
                seed: int) -> np.ndarray:
    """Predicted class per image of ``x`` [N, C, H, W], adapted at ``batch`` in stream order."""
    adaptive = Policy.load(model, method, config or None, seed=seed, threads=1)
    return np.concatenate([adaptive.step(x[s : s + batch]).argmax(1)
                           for s in range(0, len(x), batch)])


def fleet(model: str, method: str, config: dict[str, Any], x: np.ndarray, replicas: int,
          batch: int, every: int, combine: str, seed: int) -> np.ndarray:
    """Predicted class per image of ``x``: batches of ``batch`` dealt round robin to
    ``replicas`` replicas, each reporting to one fleet state every ``every`` of its own images
    (0: never) and installing the merged state it answers with, through the served fleet's own
    :class:`~eva0_edge.fleet.sync.FleetSync` (the actor and the model called in-process)."""
    models = [Policy.load(model, method, config or None, seed=seed * 1000 + r, threads=1)
              for r in range(replicas)]
    probe = models[0]
    state = FleetState(probe.state_dict(), probe.fingerprint, probe.state_sizes(), probe.method,
                       FleetConfig(combine=combine, live_s=float("inf")))
    syncs = [FleetSync(local_actor(state), f"r{r}", m, every_s=0) for r, m in enumerate(models)]
    for sync, m in zip(syncs, models, strict=True):
        sync.start(InlineWorker(m))
    unreported = [0] * replicas
    predicted = np.full(len(x), -1)
    for start in range(0, len(x), batch):
        r = (start // batch) % replicas
        rows = slice(start, start + batch)
        predicted[rows] = models[r].step(x[rows]).argmax(1)
        unreported[r] += len(x[rows])
        if every and unreported[r] >= every:
            syncs[r].sync_once()
            unreported[r] = 0
    return predicted


def run(model: str, method: str, config: dict[str, Any], limit: int, replicas: int,
        batch: int, one_batches: list[int], everies: list[int], combine: str,
        seeds: list[int], divided: bool) -> dict[str, Any]:
    spec = EvalSpec(model=model, dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=batch, methods=[method], limit=limit,
                    session=SessionSettings(threads=1))
    env_start = environment()
    names, x, y = continual_stream(spec)
    probe = Policy.load(model, method, config or None, threads=1)
    replica_config = shared_stream_config(config, probe, replicas) if divided else config
    rows: dict[str, dict[str, float]] = {}
    means: dict[str, float] = {}
    by_run: dict[str, list[float]] = {}

    def record(run: str, seed: int, predicted: np.ndarray) -> None:
        label = f"{run}, seed {seed}"
        rows[label] = per_domain(names, predicted == y)
        means[label] = float(np.mean(list(rows[label].values())))
        by_run.setdefault(run, []).append(means[label])
        print(f"{label}: {means[label]:.2f}", flush=True)

    for seed in seeds:
        for b in one_batches:
            record(f"one process B={b}", seed, one_process(model, method, config, x, b, seed))
        for every in everies:
            what = f"merged every {every} images" if every else "no merging"
            record(f"fleet x{replicas} B={batch}, {what}", seed,
                   fleet(model, method, replica_config, x, replicas, batch, every, combine, seed))
    average = {run: float(np.mean(values)) for run, values in by_run.items()}
    return {
        "model": Path(model).name, "method": method, "config": config,
        "replica_config": replica_config, "limit": limit, "replicas": replicas,
        "batch": batch, "combine": combine, "seeds": seeds, "threads": 1,
        "environment_start": env_start, "environment_end": environment(),
        "accuracy": rows, "mean": means, "average_over_seeds": average,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Fleet simulation: {report['model']}, {report['replicas']} replicas, "
        f"{report['combine']} merge",
        "",
        f"{machine_line(report)} Continual stream, severity 5, {report['limit']} test images "
        f"per corruption; replica config {report['replica_config']}; seeds {report['seeds']}.",
        "",
        "| run | mean accuracy over seeds (%) |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["average_over_seeds"].items()]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", default="eva0")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="config override of every model (as eva0-edge adapt --set)")
    parser.add_argument("--limit", type=int, default=400, help="images per corruption")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="images per replica step")
    parser.add_argument("--one-batches", default="1,16", help="one process's batch sizes")
    parser.add_argument("--every", default="0,25",
                        help="images per replica between reports, comma-separated (0: none)")
    parser.add_argument("--combine", default="mean", help="the merge rule (mean or sum)")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--undivided", action="store_true",
                        help="keep the model's activation-shift window whole in every replica")
    parser.add_argument("--out", help="folder for fleet_sim.md / .json")
    args = parser.parse_args(argv)
    report = run(args.model, args.method, parse_key_values(args.set or []), args.limit,
                 args.replicas, args.batch, _ints(args.one_batches), _ints(args.every),
                 args.combine, _ints(args.seeds), not args.undivided)
    print(markdown(report))
    if args.out:
        write_outputs(Path(args.out), "fleet_sim", report, markdown(report))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
