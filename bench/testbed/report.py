"""Evaluation reports: the paper's table as Markdown, JSON, a PNG of the stream (running
accuracy of every method; drift ||theta - theta0|| and mean logit norm of the runtime methods) and
a PNG of accuracy against the measured forwards per sample, with each batch size's (and, with
several severities, each severity's) Pareto front (the runs no cheaper run matches), which the
Markdown names too; ``traces.npz`` keeps every
method's per-batch hits, so two methods' runs over the same stream compare image by image at
batch 1 (:func:`read_traces`)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.runtime.atomic import atomic_write_bytes

from .output import pyplot, save_figure, tidy
from .protocols import StreamResult


def _running_accuracy(result, window: int = 20) -> np.ndarray:
    correct = np.convolve(result.batch_correct, np.ones(window), mode="valid")
    count = np.convolve(result.batch_size, np.ones(window), mode="valid")
    return 100.0 * correct / np.maximum(count, 1)


def plot_stream(results: dict, title: str, path: Path) -> None:
    """Accuracy (moving, over about 2% of the stream), drift and logit norm of every run
    against the images seen, so runs at different batch sizes line up; each run its own
    colour / line style, each domain named at its start."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    colors, styles = plt.get_cmap("tab20").colors, ["-", "--", ":", "-."]
    for i, (name, r) in enumerate(results.items()):
        if len(r.batch_correct) == 0:
            continue
        images = np.cumsum(r.batch_size)
        style = {"color": colors[i % len(colors)], "ls": styles[i // len(colors) % 4],
                 "lw": 1, "label": name}
        per_batch = images[-1] / len(images)
        window = int(np.clip(round(images[-1] / 50 / per_batch), 1, len(images)))
        axes[0].plot(images[window - 1:], _running_accuracy(r, window), **style)
        drift = np.asarray(r.drift)
        if np.isfinite(drift).any():
            axes[1].plot(images, drift, **style)
        axes[2].plot(images, r.logit_norm, **style)
    first = next(iter(results.values()))
    ends = np.cumsum(first.batch_size)
    starts = [0] + [int(ends[i - 1]) for i in range(1, len(first.batch_domain))
                    if first.batch_domain[i] != first.batch_domain[i - 1]]
    names = [first.batch_domain[0]] + [first.batch_domain[i]
                                       for i in range(1, len(first.batch_domain))
                                       if first.batch_domain[i] != first.batch_domain[i - 1]]
    for ax in axes:
        for x in starts[1:]:
            ax.axvline(x, color="grey", lw=0.3)
    for x, domain in zip(starts, names, strict=True):
        axes[0].text(x, 1.01, domain.replace("_", " "), transform=axes[0].get_xaxis_transform(),
                     rotation=35, fontsize=6, ha="left", va="bottom")
    axes[0].set_ylabel("accuracy % (moving)")
    axes[1].set_ylabel("||theta - theta0||")
    axes[2].set_ylabel("mean logit norm")
    axes[2].set_xlabel("images along the stream (grey lines: domain changes)")
    axes[2].legend(fontsize=7, ncol=4, loc="upper left")
    fig.suptitle(title)
    save_figure(fig, path)


def method_of(key: str) -> str:
    """The method of a results key (``eva0 B=16 S=3`` -> ``eva0``)."""
    return key.split(" B=")[0].split(" S=")[0]


def several_severities(results: dict[str, StreamResult]) -> bool:
    """Whether the runs stream more than one severity (then each row and panel names its)."""
    return len({r.severity for r in results.values()}) > 1


def groups(results: dict[str, StreamResult]) -> list[tuple[int, int | None]]:
    """The (batch size, severity) pairs of the runs, a Pareto front and panel each."""
    return sorted({(r.batch, r.severity) for r in results.values()},
                  key=lambda g: (g[0], -1 if g[1] is None else g[1]))


def _group_name(batch: int, severity: int | None, several: bool) -> str:
    return f"B = {batch}" + (f", S = {severity}" if several else "")


def pareto_front(results: dict[str, StreamResult], batch: int,
                 severity: int | None = None) -> list[str]:
    """The runs at batch size ``batch`` (and, given, severity ``severity``) that no other run
    beats: by measured forwards per sample, each more accurate (average %) than every run
    that costs no more. Runs without a measured forward count (the torch baselines) are left
    out."""
    runs = sorted(
        ((r.forwards_per_sample, -r.average, name) for name, r in results.items()
         if r.batch == batch and (severity is None or r.severity == severity)
         and r.forwards_per_sample is not None and np.isfinite(r.average)),
    )
    front: list[str] = []
    best = -np.inf
    for _, negative_average, name in runs:
        if -negative_average > best:
            front.append(name)
            best = -negative_average
    return front


def plot_pareto(results: dict[str, StreamResult], title: str, path: Path) -> None:
    """Average accuracy against measured forwards per sample, one panel per batch size (and
    severity, when several), every run a labelled point, the Pareto front a line."""
    plt = pyplot()
    panels, several = groups(results), several_severities(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (batch, severity) in zip(axes[0], panels, strict=True):
        for name, r in results.items():
            if (r.batch, r.severity) == (batch, severity) and r.forwards_per_sample is not None:
                ax.scatter(r.forwards_per_sample, r.average, s=20)
                ax.annotate(method_of(name), (r.forwards_per_sample, r.average),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = [results[name] for name in pareto_front(results, batch, severity)]
        ax.plot([r.forwards_per_sample for r in front], [r.average for r in front],
                color="black", lw=0.8, label="Pareto front")
        ax.set_title(_group_name(batch, severity, several), fontsize=9)
        ax.set_xlabel("forwards per sample (measured)")
        ax.set_ylabel("average accuracy %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def table_rows(results: dict[str, StreamResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paper's table: method, batch size, severity (when the runs
    have several), each domain's accuracy, average, the forwards per sample the run measured
    (every forward counts) and the final drift ||theta - theta0|| of the runtime methods."""
    domains = list(next(iter(results.values())).accuracy)
    level = ["S"] if several_severities(results) else []
    header = ["method", "B", *level, *domains, "avg", "fwd/sample", "drift", "trips"]
    rows = [
        [
            method_of(name), str(r.batch), *([str(r.severity)] if level else []),
            *(_percent(r.accuracy[d]) for d in domains),
            _percent(r.average), _forwards(r), _drift(r), _trips(r),
        ]
        for name, r in results.items()
    ]
    return header, rows


def _percent(value: float) -> str:
    return f"{value:.1f}" if np.isfinite(value) else "-"


def _forwards(result: StreamResult) -> str:
    fps = result.forwards_per_sample
    return "" if fps is None else f"{fps:.2f}"


def _drift(result: StreamResult) -> str:
    drift = result.final_stats.get("drift")
    return "" if drift is None else f"{drift:.3g}"


def _trips(result: StreamResult) -> str:
    guard = result.final_stats.get("guard")
    return "" if not guard else str(guard["trips"])


def results_json(results: dict[str, StreamResult], spec: dict[str, Any]) -> str:
    """The report's JSON: the spec and per run its batch size, severity (when the runs have
    several), accuracy per domain, average, forwards per sample, final statistics and
    ``gradual``'s per-step accuracy (``steps``)."""
    several = several_severities(results)
    payload = {
        "spec": spec,
        "results": {
            name: {
                "batch_size": r.batch,
                **({"severity": r.severity} if several else {}),
                "accuracy": {d: _json_number(v) for d, v in r.accuracy.items()},
                "average": _json_number(r.average),
                "skipped_steps": r.skipped_steps,
                "forwards_per_sample": r.forwards_per_sample,
                "final_stats": r.final_stats,
                **({"steps": [{**step, "accuracy": _json_number(step["accuracy"])}
                              for step in r.steps]} if r.steps else {}),
            }
            for name, r in results.items()
        },
    }
    return json.dumps(tidy(payload), indent=2)


def paired_gap(a: np.ndarray, b: np.ndarray) -> tuple[float, float, int, int]:
    """Accuracy of ``a`` minus ``b`` (points) on the same images (bool hits [N] each), its
    standard error 100 sqrt(n_a + n_b) / N (McNemar's, n_a and n_b the images only ``a`` /
    only ``b`` gets right), n_a and n_b."""
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    n = len(a)
    gap, se = 100.0 * (only_a - only_b) / n, 100.0 * float(np.sqrt(only_a + only_b)) / n
    return gap, se, only_a, only_b


def traces_npz(results: dict[str, StreamResult]) -> bytes:
    """The per-batch traces of every method as one ``.npz``: ``methods`` [M] (names) and, for
    method i, ``batch_correct_i`` / ``batch_size_i`` int32 [batches] and ``batch_domain_i``
    [batches] (domain names), in stream order."""
    arrays: dict[str, np.ndarray] = {"methods": np.array(list(results), dtype=str)}
    for i, r in enumerate(results.values()):
        arrays[f"batch_correct_{i}"] = np.asarray(r.batch_correct, dtype=np.int32)
        arrays[f"batch_size_{i}"] = np.asarray(r.batch_size, dtype=np.int32)
        arrays[f"batch_domain_{i}"] = np.array(r.batch_domain, dtype=str)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def read_traces(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """``traces.npz`` back: per method, ``batch_correct`` / ``batch_size`` / ``batch_domain``."""
    with np.load(path, allow_pickle=False) as data:
        return {str(name): {key: data[f"{key}_{i}"]
                            for key in ("batch_correct", "batch_size", "batch_domain")}
                for i, name in enumerate(data["methods"])}


def _json_number(value: float) -> float | None:
    """JSON has no NaN: an unscored accuracy is null."""
    return value if np.isfinite(value) else None


def markdown_table(results: dict[str, StreamResult]) -> str:
    header, rows = table_rows(results)
    short = [h.replace("_noise", "").replace("_blur", "").replace("_transform", "")
             .replace("_compression", "") for h in header]
    lines = ["| " + " | ".join(short) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pareto_lines(results: dict[str, StreamResult]) -> str:
    """One line per batch size (and severity, when several) naming its Pareto front, cheapest
    first."""
    lines = []
    several = several_severities(results)
    for batch, severity in groups(results):
        front = [f"{method_of(name)} ({results[name].forwards_per_sample:.2f} fwd, "
                 f"{results[name].average:.1f}%)"
                 for name in pareto_front(results, batch, severity)]
        if front:
            lines.append(f"Pareto front, {_group_name(batch, severity, several)}: "
                         f"{' -> '.join(front)}")
    return "\n".join(lines)


def severity_words(spec: dict[str, Any]) -> str:
    """The severities of a spec in words: ``severity 5``, ``severities 1,3,5``, or
    ``gradual``'s ``severity 1->5->1``."""
    if spec["protocol"] == "gradual":
        return "severity 1->5->1"
    severity = spec["severity"]
    if isinstance(severity, int):
        return f"severity {severity}"
    return f"severities {','.join(map(str, severity))}"


def write_report(results: dict, spec: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``results.md``, ``results.json``, ``traces.npz``, ``stream.png`` and ``pareto.png``
    into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = spec.get("batch_sizes") or [spec["batch_size"]]
    split = spec.get("split") or "test"
    data = (f"clean {split} images" if spec.get("corruptions") == ["clean"]
            else f"{spec['dataset']} {severity_words(spec)}"
            + ("" if split == "test" else f", {split} split"))
    title = f"{spec['model']} - {data}, {spec['protocol']}, batch {','.join(map(str, sizes))}"
    front = pareto_lines(results)
    md = (f"## {title}\n\n{markdown_table(results)}\n\n" + (f"{front}\n\n" if front else "")
          + f"```json\n{json.dumps(spec)}\n```\n")
    paths = {"md": out_dir / "results.md", "json": out_dir / "results.json",
             "traces": out_dir / "traces.npz", "png": out_dir / "stream.png",
             "pareto": out_dir / "pareto.png"}
    atomic_write_bytes(paths["md"], md.encode())
    atomic_write_bytes(paths["json"], results_json(results, spec).encode())
    atomic_write_bytes(paths["traces"], traces_npz(results))
    plot_stream(results, title, paths["png"])
    plot_pareto(results, title, paths["pareto"])
    return paths
