"""What every benchmark writes (``<stem>.json``, ``<stem>.md``, ``<stem>.png``) and the line that
records the machine beside its numbers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eva0_edge.runtime.atomic import atomic_write_bytes


def load_text(load: Any) -> str:
    """A load average (1, 5, 15 min) as ``0.52 / 0.61 / 0.70``."""
    return " / ".join(f"{float(v):.2f}" for v in load)


def machine_line(report: dict[str, Any]) -> str:
    """CPU, cores, ORT version, threads and the load average before -> after the run."""
    env = report["environment_start"]
    line = (
        f"CPU {env['cpu']} ({env['cores']} cores), "
        + (f"GPU {env['gpu']}, " if env.get("gpu") else "")
        + f"ORT {env['onnxruntime']}, provider {report.get('provider', 'cpu')}, threads "
        f"{report['threads']}, load average (1 / 5 / 15 min) {load_text(env['load_average'])} "
        f"-> {load_text(report['environment_end']['load_average'])}"
    )
    if "repeats" in report:
        line += f"; median of {report['repeats']} interleaved repetitions"
    return line + "."


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out, write as PNG (110 dpi) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def tidy(value: Any) -> Any:
    """``value`` with every float rounded to 10 significant digits (80.52, not the
    80.52000000000001 a sum of percentages leaves), for JSON."""
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, dict):
        return {k: tidy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [tidy(v) for v in value]
    return value


def write_outputs(
    out_dir: Path, stem: str, report: dict[str, Any], markdown: str,
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """Write the report as JSON, its table as Markdown and (if given) its plot as PNG."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / f"{stem}.json", json.dumps(tidy(report), indent=2).encode())
    atomic_write_bytes(out_dir / f"{stem}.md", markdown.encode())
    if plot is not None:
        plot(report, out_dir / f"{stem}.png")
