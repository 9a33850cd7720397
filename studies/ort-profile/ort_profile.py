"""Where an ORT call's time goes: ONNX Runtime's profiler, summed by operator type.

    python studies/ort-profile/ort_profile.py --arch resnet50_gn --batch 8 --out out/profile-r50

Profiles a NoAdapt forward (B rows) and an EVA-0 step (one call over 2B rows) on the same model
and prints, per operator type, the milliseconds per sample of each and their ratio: the ops whose
ratio exceeds 2 are where the step costs more than two forwards. Writes ``profile.json`` and
``profile.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import write_outputs
from eva0_edge.bench.testbed.workload import export_random, random_batch
from eva0_edge.runtime.cache import cache_dir
from eva0_edge.runtime.engine import Engine
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession


def op_times(path: str, method: str, batch: int, steps: int, threads: int | None) -> dict:
    """Milliseconds per sample by operator type over ``steps`` steps (after one warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        session = AdaptableSession(path, None, "cpu", threads,
                                   profile_prefix=str(Path(tmp) / method))
        model = Policy(Engine(session, method))
        x = random_batch(read_metadata(path), batch)
        for _ in range(steps + 1):
            model.step(x)
        events = json.loads(Path(model.session.session.end_profiling()).read_text())
    runs = sorted((e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    after_warmup = runs[0] if runs else 0
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if (event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time")
                and event["ts"] >= after_warmup):
            totals[event["args"]["op_name"]] += event["dur"] / 1000.0
    return {op: ms / (steps * batch) for op, ms in totals.items()}


def run_profile(model: str, batch: int, steps: int, threads: int | None) -> dict[str, Any]:
    noadapt = op_times(model, "noadapt", batch, steps, threads)
    eva0 = op_times(model, "eva0", batch, steps, threads)
    ops = sorted(set(noadapt) | set(eva0), key=lambda o: -eva0.get(o, 0.0))
    rows = [{"op": op, "noadapt_ms": noadapt.get(op, 0.0), "eva0_ms": eva0.get(op, 0.0),
             "ratio": eva0.get(op, 0.0) / noadapt[op] if noadapt.get(op) else None}
            for op in ops]
    return {"model": Path(model).name, "architecture": read_metadata(model).architecture,
            "batch": batch, "steps": steps, "threads": threads or "ort default",
            "environment": environment(), "rows": rows,
            "total_noadapt_ms": sum(noadapt.values()), "total_eva0_ms": sum(eva0.values())}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"## ORT kernel time by operator: {report['architecture']}, batch {report['batch']}",
        "",
        f"CPU {env['cpu']} ({env['cores']} cores), ORT {env['onnxruntime']}, load average "
        f"{env['load_average']}; {report['steps']} profiled steps after one warm-up. Kernel time "
        f"only: NoAdapt {report['total_noadapt_ms']:.2f} ms/sample, EVA-0 "
        f"{report['total_eva0_ms']:.2f} ms/sample "
        f"({report['total_eva0_ms'] / report['total_noadapt_ms']:.2f}x).",
        "",
        "| op | NoAdapt ms/sample | EVA-0 ms/sample | x |",
        "|---|---|---|---|",
    ]
    for r in report["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['op']} | {r['noadapt_ms']:.3f} | {r['eva0_ms']:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="adaptable .onnx file (default: --arch, random weights)")
    parser.add_argument("--arch", default="resnet50_gn")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model = args.model or str(export_random(args.arch, cache_dir() / "bench-models"))
    report = run_profile(model, args.batch, args.steps, args.threads)
    text = markdown(report)
    print(text)
    if args.out:
        write_outputs(Path(args.out), "profile", report, text)


if __name__ == "__main__":
    main()
