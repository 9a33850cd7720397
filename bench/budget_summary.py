"""The compute-budget table and Pareto plot (``make budget``, ``make pareto``): accuracy
against the forwards per sample each run measured, every method and EVA-0 at several budgets,
per protocol and severity, from the eval reports ``<reports>/<folder>/results.json`` (each
report's spec names its model, protocol, severity, budget and domain-memory bank; ``make
budget`` names its folders ``<model>-<label>``, label ``full``: the methods at their own cost,
a number: EVA-0 at that ``--budget``; ``make pareto`` ``<model>-<protocol>-<label>``).

    python -m eva0_edge.bench.budget_summary out/budget
    python -m eva0_edge.bench.budget_summary out/budget-vit --keep results/budget/budget.json

``--keep`` reruns part of a table: the rows of an earlier summary's ``budget.json`` stay unless
the new reports have a row of the same model, protocol, severity, method, bank and batch size
(a row of an earlier summary without a severity or bank is severity 5, no bank: all ``make
budget`` ran).

Prints a Markdown table and writes ``<reports>/budget.md``, ``budget.json`` and
``budget.png`` (one panel per model, protocol, severity and batch size: average accuracy
against forwards per sample, the Pareto front a line; the table marks the front's rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .testbed.output import pyplot, save_figure, write_outputs
from .testbed.protocols import PROTOCOLS

GRADUAL = "1->5->1"  # the severity label of the gradual protocol's rows
BANK_KEY = "bank_slots"  # the config key of the domain-memory bank's size (0: no bank)


def severity_of(spec: dict[str, Any], result: dict[str, Any]) -> str:
    """A row's severity label: the run's own (a report of several severities), else the
    spec's, ``gradual``'s :data:`GRADUAL`."""
    if spec["protocol"] == "gradual":
        return GRADUAL
    return str(result.get("severity", spec.get("severity", 5)))


def summarise(reports: Path) -> list[dict[str, Any]]:
    """One row per (model, protocol, severity, method, budget, bank, batch size): the average
    accuracy (%) over the stream's domains, the measured forwards per sample and whether the
    row is on its panel's Pareto front."""
    rows = []
    for path in sorted(reports.glob("*/results.json")):
        report = json.loads(path.read_text())
        spec = report["spec"]
        overrides = spec.get("overrides") or {}
        budget = overrides.get("budget")
        for name, result in report["results"].items():
            method = name.split(" B=")[0].split(" S=")[0]
            rows.append({
                "model": Path(spec["model"]).stem,
                "method": method if budget is None else f"{method} budget {budget:g}",
                "bank": int(overrides.get(BANK_KEY) or 0),
                "batch_size": result["batch_size"],
                "severity": severity_of(spec, result),
                "average": round(result["average"], 2),
                "forwards_per_sample": round(result["forwards_per_sample"], 3),
                "protocol": spec["protocol"], "images_per_domain": spec.get("limit"),
            })
    return _in_table_order(rows)


def _panel(row: dict[str, Any]) -> tuple[str, str, str, int]:
    """The panel of a row: model, protocol, severity, batch size."""
    return row["model"], row["protocol"], str(row.get("severity", 5)), row["batch_size"]


def _in_table_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By panel (protocols in :data:`PROTOCOLS` order), measured forwards per sample, method,
    bank; each row's ``front`` marked (:func:`_mark_front`)."""
    def order(r: dict[str, Any]) -> tuple:
        model, protocol, severity, batch = _panel(r)
        rank = PROTOCOLS.index(protocol) if protocol in PROTOCOLS else len(PROTOCOLS)
        return (model, rank, protocol, severity, batch, r["forwards_per_sample"], r["method"],
                r.get("bank", 0))

    _mark_front(rows)
    return sorted(rows, key=order)


def _mark_front(rows: list[dict[str, Any]]) -> None:
    """Set each row's ``front``: more accurate than every row of its panel that costs no more
    (of equally cheap and accurate rows, the first by method name only)."""
    best: dict[tuple, float] = {}
    for r in sorted(rows, key=lambda r: (r["forwards_per_sample"], -r["average"], r["method"])):
        panel = _panel(r)
        r["front"] = r["average"] > best.get(panel, float("-inf"))
        best[panel] = max(best.get(panel, float("-inf")), r["average"])


def _key(row: dict[str, Any]) -> tuple:
    return (*_panel(row), row["method"], row.get("bank", 0))


def merged(new: list[dict[str, Any]], kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``new`` rows and the ``kept`` ones they do not replace (same model, protocol, severity,
    method, bank and batch size), in the table's order."""
    replaced = {_key(r) for r in new}
    return _in_table_order(new + [r for r in kept if _key(r) not in replaced])


def bank_label(row: dict[str, Any]) -> str:
    """``no bank``, or the bank's size in slots."""
    slots = row.get("bank", 0)
    return f"bank {slots}" if slots else "no bank"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table, a row per run; ``front``: on its panel's Pareto front."""
    lines = ["| model | protocol | S | B | method | bank | fwd/sample | avg | front |",
             "|---" * 9 + "|"]
    for r in rows:
        model, protocol, severity, batch = _panel(r)
        lines.append(f"| {model} | {protocol} | {severity} | {batch} | {r['method']} | "
                     f"{bank_label(r)} | {r['forwards_per_sample']:.2f} | "
                     f"{r['average']:.2f} | {'yes' if r.get('front') else ''} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """A grid of panels: a row per model, protocol and severity, a column per batch size;
    every run a labelled point (method, budget, bank), the Pareto front a line."""
    rows = report["rows"]
    lines = list(dict.fromkeys(_panel(r)[:3] for r in rows))
    batches = sorted({r["batch_size"] for r in rows})
    plt = pyplot()
    fig, axes = plt.subplots(len(lines), len(batches), figsize=(4.2 * len(batches),
                             3.4 * len(lines)), squeeze=False)
    for (model, protocol, severity), row_axes in zip(lines, axes, strict=True):
        for ax, batch in zip(row_axes, batches, strict=True):
            mine = [r for r in rows if _panel(r) == (model, protocol, severity, batch)]
            for r in mine:
                label = r["method"] + (f", {bank_label(r)}" if r.get("bank") else "")
                ax.scatter(r["forwards_per_sample"], r["average"], s=24)
                ax.annotate(label, (r["forwards_per_sample"], r["average"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
            front = [r for r in mine if r.get("front")]
            ax.plot([r["forwards_per_sample"] for r in front], [r["average"] for r in front],
                    color="black", lw=0.8)
            ax.set_title(f"{model}, {protocol}, S {severity}, B = {batch}", fontsize=9)
            ax.set_xlabel("forwards per sample (measured)")
            ax.set_ylabel("average accuracy (%)")
            ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, help="folder of eval reports (<folder>/"
                        "results.json)")
    parser.add_argument("--keep", type=Path, help="an earlier budget.json whose rows stay "
                        "where the reports have none of the same model, protocol, severity, "
                        "method, bank and batch size")
    args = parser.parse_args(argv)
    rows = summarise(args.reports)
    if not rows:
        parser.error(f"no <folder>/results.json under {args.reports}")
    if args.keep:
        rows = merged(rows, json.loads(args.keep.read_text())["rows"])
    table = markdown(rows)
    print(table)
    write_outputs(args.reports, "budget", {"rows": rows}, table + "\n", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
