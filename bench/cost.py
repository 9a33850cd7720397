"""``eva0-edge bench``: what one step costs, per sample, side by side in one process.

Methods (all on the same model file, same batch of random normalised pixels):
* ``noadapt``: one ORT forward per sample (the reference of every ratio);
* ``eva0`` / ``zoa`` / ``spsa2-shared`` / ``eva0-dagger``: a full runtime step (perturbation
  draw, one ORT call over 2B rows with the shared prefix, losses, update);
* ``eva0-lowmem``: the EVA-0 step with ``low_memory`` (the +/- copies as two ORT calls);
* ``foa``: FOA's forward cost, 28 full forwards per sample (28B rows with the images tiled, so no
  prefix is shared: FOA's prompts enter at the input). The CMA-ES update itself is not timed;
* ``tent``: TENT in torch on the same architecture and weights: forward, entropy, backward,
  SGD on every norm affine.

Timing: warm-up, then repetitions interleaved across methods (round-robin, so a load spike hits
all of them), medians. Peak memory: each (method, batch) runs again in its own process and
reports its peak RSS (``ru_maxrss``). The share of an EVA-0 step spent outside ORT is measured by
timing ``session.run`` inside the step.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from eva0_edge.runtime.engine import METHODS, AdaptiveModel
from eva0_edge.runtime.modelfile import read_metadata

from .output import machine_line, pyplot, save_figure
from .output import write_outputs as write_bench_outputs

FOA_FORWARDS = 28
COST_METHODS = (*sorted(METHODS), "eva0-lowmem", "foa", "tent")


def random_batch(metadata, batch: int, seed: int = 0) -> np.ndarray:
    """Pixels of random [0, 1] images normalised as the model expects: [B, C, H, W]."""
    pre = metadata.preprocessing
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (batch, *pre.input_size)).astype(np.float32)
    mean = np.asarray(pre.mean, np.float32)[:, None, None]
    std = np.asarray(pre.std, np.float32)[:, None, None]
    return (x - mean) / std


class _OrtTimer:
    """Wraps an AdaptableSession's ``run`` to add up the seconds spent inside ORT."""

    def __init__(self, model: AdaptiveModel) -> None:
        self.seconds = 0.0
        inner = model.session.run

        def timed(x, theta):
            start = time.perf_counter()
            try:
                return inner(x, theta)
            finally:
                self.seconds += time.perf_counter() - start

        model.session.run = timed


def make_step(
    method: str, model_path: str, batch: int, threads: int | None, torch_model_fn=None
) -> tuple[Callable[[], None], Callable[[], float] | None]:
    """A zero-argument callable doing one step of ``method`` on a fixed batch, and (for
    runtime methods) a callable returning the ORT seconds accumulated so far."""
    metadata = read_metadata(model_path)
    x = random_batch(metadata, batch)
    if method in METHODS or method == "eva0-lowmem":
        model = AdaptiveModel.load(
            model_path, method.removesuffix("-lowmem"), seed=0, provider="cpu", threads=threads,
            low_memory=method.endswith("-lowmem"),
        )
        timer = _OrtTimer(model)
        return (lambda: model.step(x)), (lambda: timer.seconds)
    if method == "foa":
        model = AdaptiveModel.load(model_path, "noadapt", provider="cpu", threads=threads)
        tiled = np.concatenate([x] * FOA_FORWARDS)
        theta = np.tile(metadata.theta0, (FOA_FORWARDS * batch, 1))
        session = model.session
        return (lambda: session.run(tiled, theta)), None
    if method == "tent":
        import torch

        from .backprop import BackpropTTA

        if threads:
            torch.set_num_threads(threads)
        tta = BackpropTTA("tent", torch_model_fn(), metadata, None, batch)
        return (lambda: tta.step(x)), None
    raise ValueError(f"unknown cost method {method!r}; known: {COST_METHODS}")


@dataclass
class CostRow:
    method: str
    batch: int
    ms_per_sample: float
    ratio_to_noadapt: float | None = None
    peak_rss_mb: float | None = None
    rss_ratio_to_noadapt: float | None = None
    outside_ort_share: float | None = None
    samples: list[float] = field(default_factory=list)


def time_methods(
    model_path: str,
    methods: Sequence[str],
    batch: int,
    repeats: int,
    warmup: int,
    threads: int | None,
    torch_model_fn=None,
) -> list[CostRow]:
    """Interleaved timing of every method at one batch size; medians in ms per sample."""
    steps = {m: make_step(m, model_path, batch, threads, torch_model_fn) for m in methods}
    for _ in range(warmup):
        for step, _ in steps.values():
            step()
    ort_before = {m: (clock() if clock else 0.0) for m, (_, clock) in steps.items()}
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m, (step, _) in steps.items():
            start = time.perf_counter()
            step()
            samples[m].append(time.perf_counter() - start)
    rows = []
    for m in methods:
        total = float(np.sum(samples[m]))
        row = CostRow(m, batch, 1000.0 * float(np.median(samples[m])) / batch,
                      samples=[1000.0 * s / batch for s in samples[m]])
        clock = steps[m][1]
        if clock and m != "noadapt":
            row.outside_ort_share = max(0.0, 1.0 - (clock() - ort_before[m]) / total)
        rows.append(row)
    return rows


def peak_rss_mb(
    model_path: str, method: str, batch: int, steps: int, threads: int | None,
    torch_spec: dict | None,
) -> float:
    """Peak RSS (MB) of a fresh process that loads the model and runs ``steps`` steps."""
    cmd = [sys.executable, "-m", "eva0_edge.bench.cost", "--worker", model_path, method,
           str(batch), str(steps), str(threads or 0), json.dumps(torch_spec or {})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"memory worker for {method} failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"])


def torch_model_loader(torch_spec: dict | None, model_path: str):
    """Build the torch twin of the model file: timm ``arch`` with ``seed`` (random weights, as
    exported by :func:`export_random`) or the shipped/checkpointed source model."""
    def load():
        import torch

        if torch_spec and torch_spec.get("arch"):
            import timm

            torch.manual_seed(torch_spec.get("seed", 0))
            return timm.create_model(torch_spec["arch"]).eval()
        from .backprop import load_torch_source

        return load_torch_source(read_metadata(model_path), (torch_spec or {}).get("checkpoint"))

    return load


def export_random(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Export timm ``arch`` with random weights (seeded) into ``out_dir`` once; reuse after."""
    path = out_dir / f"{arch}-seed{seed}.onnx"
    if not path.is_file():
        import torch

        from eva0_edge.exporter import export_model

        torch.manual_seed(seed)
        export_model(arch, path)
    return path


def environment() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "onnxruntime": ort.__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def run_bench(
    model_path: str,
    batch_sizes: Sequence[int],
    methods: Sequence[str],
    repeats: int = 10,
    warmup: int = 2,
    threads: int | None = None,
    memory: bool = True,
    torch_spec: dict | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every method at every batch size, measure peak memory, and return a report dict."""
    unknown = [m for m in methods if m not in COST_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(COST_METHODS)}")
    methods = ["noadapt", *[m for m in methods if m != "noadapt"]]
    env_start = environment()
    rows: list[CostRow] = []
    torch_fn = torch_model_loader(torch_spec, model_path) if "tent" in methods else None
    for batch in batch_sizes:
        batch_rows = time_methods(model_path, methods, batch, repeats, warmup, threads, torch_fn)
        base = batch_rows[0].ms_per_sample
        for row in batch_rows:
            row.ratio_to_noadapt = row.ms_per_sample / base
        if memory:
            for row in batch_rows:
                row.peak_rss_mb = peak_rss_mb(model_path, row.method, batch,
                                              max(3, warmup + 1), threads, torch_spec)
            for row in batch_rows:
                row.rss_ratio_to_noadapt = row.peak_rss_mb / batch_rows[0].peak_rss_mb
        rows += batch_rows
        if progress:
            print(f"batch {batch}: " + ", ".join(
                f"{r.method} {r.ms_per_sample:.2f} ms ({r.ratio_to_noadapt:.2f}x)"
                for r in batch_rows), flush=True)
    return {
        "model": Path(model_path).name,
        "architecture": read_metadata(model_path).architecture,
        "threads": threads or "ort default",
        "repeats": repeats,
        "warmup": warmup,
        "environment_start": env_start,
        "environment_end": environment(),
        "rows": [row.__dict__ for row in rows],
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Step cost: {report['architecture']} ({report['model']})",
        "",
        machine_line(report),
        "",
        "| method | batch | ms / sample | x NoAdapt | peak RSS MB | RSS x NoAdapt | outside ORT |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)

        lines.append(
            f"| {r['method']} | {r['batch']} | {r['ms_per_sample']:.3f} | "
            f"{fmt(r['ratio_to_noadapt'], '.2f')} | {fmt(r['peak_rss_mb'], '.0f')} | "
            f"{fmt(r['rss_ratio_to_noadapt'], '.2f')} | "
            f"{fmt(r['outside_ort_share'] and 100 * r['outside_ort_share'], '.1f')}"
            f"{'%' if r['outside_ort_share'] is not None else ''} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    for m in methods:
        rows = [r for r in report["rows"] if r["method"] == m]
        batches = [r["batch"] for r in rows]
        axes[0].plot(batches, [r["ms_per_sample"] for r in rows], "o-", label=m)
        axes[1].plot(batches, [r["ratio_to_noadapt"] for r in rows], "o-", label=m)
    axes[1].axhline(2.0, color="grey", ls="--", lw=0.8)
    for ax, label in zip(axes, ("ms per sample", "x NoAdapt (same batch)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"step cost: {report['architecture']}")
    save_figure(fig, path)


def write_outputs(report: dict[str, Any], out_dir: Path) -> None:
    """``cost.json``, ``cost.md`` and ``cost.png`` in ``out_dir``."""
    write_bench_outputs(out_dir, "cost", report, markdown(report), plot)


def process_peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM) in MB. Not ``ru_maxrss``: Linux carries that across
    fork + exec, so a worker would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _worker(argv: list[str]) -> None:
    model_path, method, batch, steps, threads, torch_spec = argv
    spec = json.loads(torch_spec)
    loader = torch_model_loader(spec, model_path) if method == "tent" else None
    step, _ = make_step(method, model_path, int(batch), int(threads) or None, loader)
    for _ in range(int(steps)):
        step()
    print(json.dumps({"peak_rss_mb": process_peak_rss_mb()}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
