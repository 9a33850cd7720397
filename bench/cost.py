"""``eva0-edge bench``: what one step costs, per sample, side by side in one process.

Methods (all on the same batch of random normalised pixels):
* ``noadapt``: one ORT forward per sample on the one-file session, plain inference (the
  reference of every ratio);
* ``eva0`` / ``zoa`` / ``spsa2-shared`` / ``eva0-dagger``: a full runtime step (perturbation
  draw, ORT calls over 2B rows with the shared prefix, losses, update) on the session
  ``adapt`` and ``serve`` run by default (:class:`SessionSettings`' defaults: split sessions,
  the prefix once on B rows and the suffix in calls as large as the default 16 MiB budget
  holds, unless the file cannot be split; IOBinding on CUDA only); every row records the
  session it ran (``session``: split, io_binding, low_memory as resolved);
* ``eva0-onecall`` (any runtime method + ``-onecall``): the step on the one-file session, one
  ORT call over all rows;
* ``eva0-lowmem`` (any runtime method + ``-lowmem``): the step with ``low_memory`` (the copies
  as separate ORT calls of B rows: EVA-0's +/- pair as two, FOA's 28 candidates as 28);
* ``eva0-iob`` (any runtime method + ``-iob``, combinable with ``-lowmem``): the step through
  ORT's IOBinding with reused output buffers (``io_binding``);
* ``eva0-split`` (any runtime method + ``-split``): split sessions required (an error where the
  file cannot be split);
* ``eva0-hoststep`` (any runtime method + ``-hoststep``): on CUDA, the step's arrays on the host
  (the CPU path's numbers) instead of the default device step (:mod:`~.runtime.device_step`);
* ``foa`` / ``foa-dagger`` / ``eva0-clubs``: the prompt methods' full steps (FOA: CMA-ES ask,
  one ORT call over 28B rows, fitness, tell, activation shift) on the prompt variant of the same
  weights (``--arch`` exports it; ``name@FP`` sets #FP);
* ``tent``: TENT in torch on the same architecture and weights: forward, entropy, backward,
  SGD on every norm affine.

The health guard is off in every runtime step timed here: on random pixels it trips at once
and the steps after it would be its pause, not the method's step.

``--budgets F,...`` adds a row ``METHOD budget F`` per adapting runtime method and budget:
the controller with that compute budget (:mod:`eva0_edge.runtime.budget`) in its settled
schedule (the steady state on a stream the model has learnt: a batch adapted on whenever the
bucket is full, the others served with one forward). Its time is the *mean* over the
repetitions, since the cost alternates between the two kinds of batch, and its forwards per
sample are read from the session's forward counter over the timed repetitions.

Timing: warm-up, then repetitions interleaved across methods (round-robin, so a load spike hits
all of them), medians. Peak memory: each (method, batch) runs again in its own process and
reports its peak RSS (``ru_maxrss``). The share of a runtime step spent outside ORT comes from the
session's own ORT clock (``ForwardCounter.ort_seconds``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.runtime.methods import RUNTIME_METHODS, base_name, is_prompt_method, load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.progress import progress_bar
from eva0_edge.runtime.registry import parse_method, spec_of
from eva0_edge.runtime.session import AdaptableSession, SessionSettings

from .testbed.machine import environment, process_peak_rss_mb
from .testbed.output import machine_line, pyplot, save_figure
from .testbed.output import write_outputs as write_bench_outputs
from .testbed.workload import export_random, random_batch

# method suffix -> the session setting it fixes
SESSION_MODES: dict[str, tuple[str, bool]] = {
    "-lowmem": ("low_memory", True), "-iob": ("io_binding", True), "-split": ("split", True),
    "-onecall": ("split", False), "-hoststep": ("device_step", False),
}
COST_METHODS = (*RUNTIME_METHODS, *(f"eva0{suffix}" for suffix in SESSION_MODES), "tent")
PROMPT_TOKENS = 3


def session_mode(name: str) -> tuple[str, dict[str, bool | None]]:
    """``name`` without its session-mode suffixes, and the session settings
    (:class:`SessionSettings` fields) its step runs with: an adapting method without a suffix
    takes ``adapt``'s and ``serve``'s defaults (split sessions unless the file cannot be split,
    IOBinding on CUDA only: ``eva0`` -> {low_memory: False, io_binding: None, split: None}); a
    method that does not adapt (``noadapt``, the reference of the ratios) the one-file session
    of plain inference (split False); the suffixes fix one setting each:
    ``eva0-lowmem-iob`` -> (``eva0``, {low_memory: True, io_binding: True, split: None}, one
    file since low_memory), ``eva0-onecall`` -> split False. ValueError for an unknown
    method."""
    given: dict[str, bool] = {}
    stripped = True
    while stripped:
        stripped = False
        for suffix, (setting, value) in SESSION_MODES.items():
            if name.endswith(suffix):
                name, given[setting], stripped = name.removesuffix(suffix), value, True
    plain = not spec_of(base_name(name)).adapts
    flags: dict[str, bool | None] = {"low_memory": False, "io_binding": None,
                                     "split": False if plain else None}
    return name, {**flags, **given}


def session_label(session: dict[str, bool] | None) -> str:
    """A row's resolved session in words: ``split``, ``one call`` or ``low memory``, with
    ``+ IOBinding`` when on; ``-`` for none (TENT runs in torch)."""
    if session is None:
        return "-"
    kind = ("low memory" if session["low_memory"] else
            "split" if session["split"] else "one call")
    return kind + (" + IOBinding" if session["io_binding"] else "") + \
        (" + device step" if session.get("device_step") else "")


def resolved_session(session: AdaptableSession) -> dict[str, bool]:
    """What ``session`` runs, as resolved from its settings: split sessions or one file,
    IOBinding, low memory, the device step."""
    return {"split": session.parts is not None, "io_binding": bool(session.io_binding),
            "low_memory": bool(session.low_memory), "device_step": session.device_step}


def check_cost_method(name: str) -> None:
    """ValueError unless ``name`` is a cost method: a runtime method (``@FP`` allowed, and the
    ``-lowmem`` / ``-iob`` / ``-split`` / ``-onecall`` session-mode suffixes) or ``tent``."""
    if name == "tent":
        return
    try:
        session_mode(name)
    except ValueError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(COST_METHODS)}") from None


def budgeted(method: str) -> bool:
    """Whether ``method`` (a cost method) takes a compute budget: an adapting runtime method
    (the EVA-0 family, FOA)."""
    return method != "tent" and spec_of(base_name(session_mode(method)[0])).adapts


def own_forwards(method: str) -> int:
    """The forwards per sample of runtime method ``method`` at full rate (``@FP`` or its
    registry default)."""
    name = session_mode(method)[0]
    return parse_method(name)[1].get("forwards", spec_of(name).forwards_per_sample)


def cost_cases(
    methods: Sequence[str], budgets: Sequence[float]
) -> list[tuple[str, str, float | None]]:
    """(row name, method, budget) for every method, then ``METHOD budget F`` for every
    budgeted method and every budget up to its own forwards per sample."""
    cases: list[tuple[str, str, float | None]] = [(m, m, None) for m in methods]
    for budget in budgets:
        cases += [(f"{m} budget {budget:g}", m, budget) for m in methods
                  if budgeted(m) and budget <= own_forwards(m)]
    return cases


@dataclass
class Step:
    """One cost case ready to time: ``run`` does one step on the fixed batch; ``ort_seconds``
    and ``forwards`` read the session's ORT clock and forward counter, ``session`` is what it
    runs (:func:`resolved_session`; all None for TENT)."""

    run: Callable[[], None]
    ort_seconds: Callable[[], float] | None = None
    forwards: Callable[[], int] | None = None
    session: dict[str, bool] | None = None


def make_step(
    method: str, model_path: str, batch: int, threads: int | None, torch_model_fn=None,
    prompt_model: str | None = None, provider: str = "cpu", budget: float | None = None,
) -> Step:
    """One step of ``method`` on a fixed batch. Prompt methods run on ``prompt_model``;
    runtime methods on ORT's ``provider``, TENT in torch on the CPU. ``budget``: the
    controller's compute budget in forwards per sample, in its settled schedule."""
    metadata = read_metadata(model_path)
    x = random_batch(metadata, batch)
    if method != "tent":
        base, flags = session_mode(method)
        path = model_path
        if is_prompt_method(base):
            if prompt_model is None:
                raise ValueError(f"{method} needs a prompt model (--prompt-model or --arch)")
            path = prompt_model
        config = {"guard": False} if spec_of(base).kind == "engine" else None
        if budget is not None:
            if not budgeted(method):
                raise ValueError(f"{method} takes no compute budget")
            config = {**(config or {}), "budget": budget}
        model = load_method(path, base, config, seed=0,
                            session=SessionSettings(provider=provider, threads=threads, **flags))
        if budget is not None:
            model.budget.dense = False  # the steady state on a learnt stream (the bucket full)
        counter = model.session.counter
        return Step(lambda: model.step(x), lambda: counter.ort_seconds, lambda: counter.forwards,
                    resolved_session(model.session))
    import torch

    from .testbed.backprop import BackpropTTA

    if threads:
        torch.set_num_threads(threads)
    tta = BackpropTTA("tent", torch_model_fn(), metadata, None, batch)
    return Step(lambda: tta.step(x))


@dataclass
class CostRow:
    method: str
    batch: int
    ms_per_sample: float
    ratio_to_noadapt: float | None = None
    forwards_per_sample: float | None = None
    peak_rss_mb: float | None = None
    rss_ratio_to_noadapt: float | None = None
    gpu_load_mb: float | None = None
    gpu_peak_mb: float | None = None
    gpu_ratio_to_noadapt: float | None = None
    gpu_source: str | None = None
    outside_ort_share: float | None = None
    served_ms_per_sample: float | None = None
    session: dict[str, bool] | None = None
    samples: list[float] = field(default_factory=list)


def time_methods(
    model_path: str,
    methods: Sequence[str],
    batch: int,
    repeats: int,
    warmup: int,
    threads: int | None,
    torch_model_fn=None,
    prompt_model: str | None = None,
    provider: str = "cpu",
    tick: Callable[[], Any] | None = None,
    budgets: Sequence[float] = (),
) -> list[CostRow]:
    """Interleaved timing of every cost case (:func:`cost_cases`) at one batch size, in ms per
    sample: medians, means for the budget rows. ``tick`` is called after every step (warm-up
    included: a progress bar)."""
    cases = cost_cases(methods, budgets)
    steps = {
        name: make_step(m, model_path, batch, threads, torch_model_fn, prompt_model, provider,
                        budget)
        for name, m, budget in cases
    }
    for _ in range(warmup):
        for step in steps.values():
            step.run()
            if tick:
                tick()
    ort_before = {n: s.ort_seconds() for n, s in steps.items() if s.ort_seconds}
    forwards_before = {n: s.forwards() for n, s in steps.items() if s.forwards}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    served: dict[str, list[float]] = {name: [] for name in steps}  # one-forward batches
    for _ in range(repeats):
        for name, step in steps.items():
            forwards = step.forwards() if step.forwards else 0
            start = time.perf_counter()
            step.run()
            samples[name].append(time.perf_counter() - start)
            if step.forwards and step.forwards() - forwards == batch:
                served[name].append(samples[name][-1])
            if tick:
                tick()
    rows = []
    for name, m, budget in cases:
        seconds, step = samples[name], steps[name]
        typical = float(np.mean(seconds) if budget is not None else np.median(seconds))
        row = CostRow(name, batch, 1000.0 * typical / batch, session=step.session,
                      samples=[1000.0 * s / batch for s in seconds])
        if step.forwards:
            row.forwards_per_sample = (step.forwards() - forwards_before[name]) / (repeats * batch)
        if step.ort_seconds and m != "noadapt":
            spent = step.ort_seconds() - ort_before[name]
            row.outside_ort_share = max(0.0, 1.0 - spent / float(np.sum(seconds)))
        if budget is not None and served[name]:
            row.served_ms_per_sample = 1000.0 * float(np.mean(served[name])) / batch
        rows.append(row)
    return rows


def process_memory(
    model_path: str, method: str, batch: int, steps: int, threads: int | None,
    torch_spec: dict | None, prompt_model: str | None = None, provider: str = "cpu",
) -> dict[str, Any]:
    """Memory of a fresh process that loads the model and runs ``steps`` steps: its peak RSS
    (``peak_rss_mb``) and, on CUDA, its GPU memory (``gpu_load_mb``, ``gpu_peak_mb``,
    ``gpu_source``: see :mod:`.gpumemory`). MiB."""
    cmd = [sys.executable, "-m", "eva0_edge.bench.cost", "--worker", model_path, method,
           str(batch), str(steps), str(threads or 0), json.dumps(torch_spec or {}),
           prompt_model or "", provider]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"memory worker for {method} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def torch_model_loader(torch_spec: dict | None, model_path: str):
    """Build the torch twin of the model file: timm ``arch`` with ``seed`` (random weights, as
    exported by :func:`export_random`) or the shipped/checkpointed source model."""
    def load():
        import torch

        if torch_spec and torch_spec.get("arch"):
            import timm

            torch.manual_seed(torch_spec.get("seed", 0))
            return timm.create_model(torch_spec["arch"]).eval()
        from .testbed.backprop import load_torch_source

        return load_torch_source(read_metadata(model_path), (torch_spec or {}).get("checkpoint"))

    return load


def bench_prompt_model(
    model: str, arch: str | None, seed: int, given: str | None, methods: Sequence[str]
) -> str | None:
    """The prompt model the prompt methods of ``methods`` run on (None if there are none):
    ``given``, else the prompt export of ``arch``'s random weights, else the shipped model's
    prompt variant."""
    if not any(m != "tent" and is_prompt_method(session_mode(m)[0]) for m in methods):
        return None
    if given:
        return given
    if arch:
        from eva0_edge.runtime.cache import cache_dir

        return str(export_random(arch, cache_dir() / "bench-models", seed, PROMPT_TOKENS))
    from .testbed.prompt_variant import prompt_variant

    return str(prompt_variant(model, PROMPT_TOKENS))


DEFAULT_METHODS = ("noadapt", "eva0", "zoa", "foa", "tent")


def fitting_methods(
    model: str, arch: str | None, seed: int, prompt_model: str | None,
    torch_checkpoint: str | None,
) -> tuple[list[str], dict[str, str]]:
    """The default methods that can run on ``model`` and, for the others, why not: FOA needs
    a prompt model of a ViT (given, exported from ``arch``, or derived from a shipped
    model), TENT the torch weights (``arch``'s random ones, a shipped model's, or
    ``torch_checkpoint``)."""
    skipped: dict[str, str] = {}
    try:
        bench_prompt_model(model, arch, seed, prompt_model, ["foa"])
    except (ValueError, FileNotFoundError) as err:
        skipped["foa"] = str(err)
    if not arch:
        from .testbed.backprop import load_torch_source

        try:
            load_torch_source(read_metadata(model), torch_checkpoint)
        except (ValueError, FileNotFoundError) as err:
            skipped["tent"] = str(err)
    return [m for m in DEFAULT_METHODS if m not in skipped], skipped


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
    prompt_model: str | None = None,
    provider: str = "cpu",
    budgets: Sequence[float] = (),
) -> dict[str, Any]:
    """Time every method at every batch size (and each budgeted method at each of
    ``budgets``, forwards per sample), measure peak memory (host RSS; on CUDA also GPU memory
    after load and at peak; not for the budget rows: a budget changes how often the step runs,
    not its peak), and return a report dict. The prompt methods run on ``prompt_model``;
    runtime methods on ORT's ``provider``."""
    for m in methods:
        check_cost_method(m)
    methods = ["noadapt", *[m for m in methods if m != "noadapt"]]
    env_start = environment()
    torch_fn = torch_model_loader(torch_spec, model_path) if "tent" in methods else None
    architecture = read_metadata(model_path).architecture  # a bad file fails before any output
    cases = len(cost_cases(methods, budgets))
    bar = progress_bar(total=len(batch_sizes) * cases * (warmup + repeats),
                       desc="timing steps", unit="step", quiet=not progress)
    try:
        rows = _time_batches(model_path, batch_sizes, methods, repeats, warmup, threads, memory,
                             torch_spec, torch_fn, progress, prompt_model, provider, bar, budgets)
    finally:
        bar.close()
    return {
        "model": Path(model_path).name,
        "prompt_model": Path(prompt_model).name if prompt_model else None,
        "architecture": architecture,
        "threads": threads or "ort default",
        "provider": provider,
        "repeats": repeats,
        "warmup": warmup,
        "budgets": list(budgets),
        "environment_start": env_start,
        "environment_end": environment(),
        "rows": [row.__dict__ for row in rows],
    }


def _time_batches(
    model_path: str, batch_sizes: Sequence[int], methods: list[str], repeats: int, warmup: int,
    threads: int | None, memory: bool, torch_spec: dict | None, torch_fn, progress: bool,
    prompt_model: str | None, provider: str, bar, budgets: Sequence[float],
) -> list[CostRow]:
    """:func:`run_bench`'s rows, batch size by batch size (``bar``: ticked every step)."""
    rows: list[CostRow] = []
    for batch in batch_sizes:
        batch_rows = time_methods(model_path, methods, batch, repeats, warmup, threads, torch_fn,
                                  prompt_model, provider, bar.update, budgets)
        base = batch_rows[0].ms_per_sample
        for row in batch_rows:
            row.ratio_to_noadapt = row.ms_per_sample / base
        if memory:
            measured_rows = [row for row in batch_rows if row.method in methods]
            for row in measured_rows:
                measured = process_memory(model_path, row.method, batch, max(3, warmup + 1),
                                          threads, torch_spec, prompt_model, provider)
                for key, value in measured.items():
                    setattr(row, key, value)
            for row in measured_rows:
                row.rss_ratio_to_noadapt = row.peak_rss_mb / batch_rows[0].peak_rss_mb
                if row.gpu_peak_mb is not None and batch_rows[0].gpu_peak_mb:
                    row.gpu_ratio_to_noadapt = row.gpu_peak_mb / batch_rows[0].gpu_peak_mb
        rows += batch_rows
        if progress:
            print(f"batch {batch}: " + ", ".join(
                f"{r.method} {r.ms_per_sample:.2f} ms ({r.ratio_to_noadapt:.2f}x)"
                for r in batch_rows), flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    gpu = any(r.get("gpu_peak_mb") is not None for r in report["rows"])
    gpu_head = " GPU MiB load / peak | GPU peak x NoAdapt |" if gpu else ""
    lines = [
        f"## Step cost: {report['architecture']} ({report['model']})",
        "",
        machine_line(report),
        "",
        "| method | batch | ms / sample | x NoAdapt | forwards / sample | peak RSS MB "
        "| RSS x NoAdapt | outside ORT | session |" + gpu_head,
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if gpu else ""),
    ]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for r in report["rows"]:
        gpu_cells = (
            f" {fmt(r.get('gpu_load_mb'), '.0f')} / {fmt(r.get('gpu_peak_mb'), '.0f')} | "
            f"{fmt(r.get('gpu_ratio_to_noadapt'), '.2f')} |" if gpu else ""
        )
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['ms_per_sample']:.3f} | "
            f"{fmt(r['ratio_to_noadapt'], '.2f')} | {fmt(r.get('forwards_per_sample'), '.2f')} | "
            f"{fmt(r['peak_rss_mb'], '.0f')} | "
            f"{fmt(r['rss_ratio_to_noadapt'], '.2f')} | "
            f"{fmt(r['outside_ort_share'] and 100 * r['outside_ort_share'], '.1f')}"
            f"{'%' if r['outside_ort_share'] is not None else ''} | "
            f"{session_label(r.get('session'))} |" + gpu_cells
        )
    lines += ["", "session: the ORT session each row ran, as resolved; an adapting method's "
              "plain name runs what `adapt` and `serve` run by default (split sessions unless "
              "the file cannot be split; IOBinding on CUDA), NoAdapt one call (plain "
              "inference), `-onecall` / `-lowmem` / `-split` / `-iob` / `-hoststep` (the CUDA "
              "step on the host) fix one setting."]
    if gpu:
        sources = sorted({r["gpu_source"] for r in report["rows"] if r.get("gpu_source")})
        lines += ["", f"GPU memory read by NVML ({', '.join(sources)}; see bench/gpumemory.py)."]
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


def _worker(argv: list[str]) -> None:
    model_path, method, batch, steps, threads, torch_spec, prompt_model, provider = argv
    spec = json.loads(torch_spec)
    loader = torch_model_loader(spec, model_path) if method == "tent" else None

    def load() -> Callable[[], None]:
        return make_step(method, model_path, int(batch), int(threads) or None, loader,
                         prompt_model or None, provider).run

    result: dict[str, Any] = {}
    if provider == "cuda" and method != "tent":
        from .gpumemory import NvmlReader, gpu_memory_of

        result.update(gpu_memory_of(load, int(steps), NvmlReader()))
    else:
        step = load()
        for _ in range(int(steps)):
            step()
    result["peak_rss_mb"] = process_peak_rss_mb()
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
