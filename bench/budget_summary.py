"""The compute-budget table and Pareto plot (``make budget``): accuracy against the forwards
per sample each run measured, every method and EVA-0 at several budgets, from the eval
reports ``<reports>/<model>-<label>/results.json`` (label ``full``: the methods at their own
cost; a number: EVA-0 at that ``--budget``).

    python -m eva0_edge.bench.budget_summary out/budget
    python -m eva0_edge.bench.budget_summary out/budget-vit --keep results/budget/budget.json

``--keep`` reruns part of a table: the rows of an earlier summary's ``budget.json`` stay unless
the new reports have a row of the same model, method and batch size.

Prints a Markdown table and writes ``<reports>/budget.md``, ``budget.json`` and
``budget.png`` (one panel per model and batch size: average accuracy against forwards per
sample).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .testbed.output import pyplot, save_figure, write_outputs


def summarise(reports: Path) -> list[dict[str, Any]]:
    """One row per (model, method, budget, batch size): the average accuracy (%) over the
    stream's domains and the measured forwards per sample."""
    rows = []
    for path in sorted(reports.glob("*/results.json")):
        report = json.loads(path.read_text())
        spec = report["spec"]
        budget = spec.get("overrides", {}).get("budget")
        for name, result in report["results"].items():
            method = name.split(" B=")[0]
            rows.append({
                "model": Path(spec["model"]).stem,
                "method": method if budget is None else f"{method} budget {budget:g}",
                "batch_size": result["batch_size"],
                "average": round(result["average"], 2),
                "forwards_per_sample": round(result["forwards_per_sample"], 3),
                "protocol": spec["protocol"], "images_per_domain": spec.get("limit"),
            })
    return _in_table_order(rows)


def _in_table_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By model, batch size, measured forwards per sample, method."""
    return sorted(rows, key=lambda r: (r["model"], r["batch_size"], r["forwards_per_sample"],
                                       r["method"]))


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["model"], row["method"], row["batch_size"]


def merged(new: list[dict[str, Any]], kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``new`` rows and the ``kept`` ones they do not replace (same model, method and batch
    size), in the table's order."""
    replaced = {_key(r) for r in new}
    return _in_table_order(new + [r for r in kept if _key(r) not in replaced])


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | B | method | fwd/sample | avg |", "|---" * 5 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['method']} | "
                     f"{r['forwards_per_sample']:.2f} | {r['average']:.2f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    rows = report["rows"]
    panels = sorted({(r["model"], r["batch_size"]) for r in rows})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["model"], r["batch_size"]) == (model, batch)]
        for r in mine:
            ax.scatter(r["forwards_per_sample"], r["average"], s=24)
            ax.annotate(r["method"], (r["forwards_per_sample"], r["average"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{model}, B = {batch}", fontsize=9)
        ax.set_xlabel("forwards per sample (measured)")
        ax.set_ylabel("average accuracy (%)")
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, help="folder of <model>-<label>/ eval reports")
    parser.add_argument("--keep", type=Path, help="an earlier budget.json whose rows stay "
                        "where the reports have none of the same model, method and batch size")
    args = parser.parse_args(argv)
    rows = summarise(args.reports)
    if not rows:
        parser.error(f"no <model>-<label>/results.json under {args.reports}")
    if args.keep:
        rows = merged(rows, json.loads(args.keep.read_text())["rows"])
    table = markdown(rows)
    print(table)
    write_outputs(args.reports, "budget", {"rows": rows}, table + "\n", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
