"""The GPU run's tables (``bench/gpu_check.sh``): step cost and GPU memory on CUDA.

    python -m eva0_edge.bench.gpu_summary RESULTS_DIR

Reads ``<dir>/bench-<arch>-cuda/cost.json`` (ms per sample of NoAdapt and, as multiples of it,
EVA-0 and ZOA in the default CUDA mode (``-split``: split sessions through IOBinding, rows per
call from the memory budget, the device step), EVA-0's step on the host (``-hoststep``) and as
one call over all rows), ``<dir>/layers-<arch>-cuda/cost.json`` (the same at the recommended
layer sets), ``<dir>/memory-<arch>-cuda/cost.json`` (GPU memory per process from NVML at one
batch size) and ``<dir>/budget-<arch>-cuda/cost.json`` (noadapt-shift, default-mode EVA-0 at
full rate and at each compute budget: time as multiples of NoAdapt's, forwards per sample as
counted, and a served batch's time under the first budget). Prints the tables it has reports
for and writes ``<dir>/gpu.md`` and ``gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from .testbed.output import write_outputs

COST_COLUMNS = (("eva0-split", "EVA-0 default"), ("eva0-split-hoststep", "EVA-0 host step"),
                ("eva0-onecall", "EVA-0 one call"), ("zoa-split", "ZOA default"),
                ("zoa-onecall", "ZOA one call"))
MEMORY_COLUMNS = (("eva0-split", "EVA-0 default"), ("eva0-split-hoststep", "EVA-0 host step"),
                  ("eva0-onecall", "EVA-0 one call"), ("eva0-lowmem", "EVA-0 low-memory"),
                  ("zoa-split", "ZOA default"))


def _reports(folder: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{kind}-*-cuda/cost.json"))]


def cost_rows(folder: Path, kind: str = "bench") -> list[dict[str, Any]]:
    """One row per (architecture, batch) of the ``kind`` reports (``bench``: the exporter's
    layer sets, ``layers``: the recommended ones): NoAdapt's ms per sample, each method's
    multiple of it and the default EVA-0 step's share outside ORT."""
    rows = []
    for report in _reports(folder, kind):
        by_key = {(r["method"], r["batch"]): r for r in report["rows"]}
        layers = re.search(r"-a([^/]+)\.onnx$", report.get("model", ""))
        model = report["architecture"] + (f" --adapt {layers[1]}" if layers else "")
        for batch in sorted({r["batch"] for r in report["rows"]}):
            row: dict[str, Any] = {"model": model, "batch_size": batch,
                                   "noadapt_ms": by_key[("noadapt", batch)]["ms_per_sample"]}
            for method, _ in COST_COLUMNS:
                found = by_key.get((method, batch))
                row[method] = None if found is None else found["ratio_to_noadapt"]
            default = by_key.get(("eva0-split", batch))
            row["eva0_split_outside_ort"] = default and default["outside_ort_share"]
            rows.append(row)
    return rows


def memory_rows(folder: Path) -> list[dict[str, Any]]:
    """One row per (architecture, batch): NoAdapt's GPU MiB after load and at the peak, each
    method's peak and its multiple of NoAdapt's."""
    rows = []
    for report in _reports(folder, "memory"):
        by_key = {(r["method"], r["batch"]): r for r in report["rows"]}
        for batch in sorted({r["batch"] for r in report["rows"]}):
            noadapt = by_key[("noadapt", batch)]
            row: dict[str, Any] = {"model": report["architecture"], "batch_size": batch,
                                   "noadapt_load_mb": noadapt["gpu_load_mb"],
                                   "noadapt_peak_mb": noadapt["gpu_peak_mb"]}
            for method, _ in MEMORY_COLUMNS:
                found = by_key.get((method, batch))
                row[method] = None if found is None else {
                    "peak_mb": found["gpu_peak_mb"], "ratio": found["gpu_ratio_to_noadapt"]}
            rows.append(row)
    return rows


def budget_rows(folder: Path) -> list[dict[str, Any]]:
    """One row per (architecture, batch): NoAdapt's ms per sample, then (multiple of NoAdapt's
    time, forwards per sample) of noadapt-shift, default-mode EVA-0 and EVA-0 at each budget
    (``columns``: their row names in the report)."""
    rows = []
    for report in _reports(folder, "budget"):
        budgets = report.get("budgets", [])
        columns = ["noadapt-shift", "eva0-split", *(f"eva0-split budget {b:g}" for b in budgets)]
        by_key = {(r["method"], r["batch"]): r for r in report["rows"]}
        for batch in sorted({r["batch"] for r in report["rows"]}):
            row: dict[str, Any] = {"model": report["architecture"], "batch_size": batch,
                                   "noadapt_ms": by_key[("noadapt", batch)]["ms_per_sample"],
                                   "columns": columns}
            for method in columns:
                found = by_key.get((method, batch))
                row[method] = None if found is None else {
                    "ratio": found["ratio_to_noadapt"],
                    "forwards_per_sample": found["forwards_per_sample"]}
            first = by_key.get((columns[2], batch)) if len(columns) > 2 else None
            served = first and first.get("served_ms_per_sample")
            row["served_ratio"] = served and served / row["noadapt_ms"]
            rows.append(row)
    return rows


def _budget_markdown(rows: list[dict[str, Any]]) -> list[str]:
    columns = rows[0]["columns"]
    names = ["noadapt-shift", "EVA-0 default",
             *(c.replace("eva0-split budget", "EVA-0 budget") for c in columns[2:])]
    served = columns[2].replace("eva0-split budget", "a served batch at") if \
        len(columns) > 2 else "a served batch"
    lines = [f"| model | B | NoAdapt ms / sample | {' | '.join(names)} | {served} |",
             "|---" * (len(names) + 4) + "|"]
    for r in rows:
        cells = ["-" if r.get(c) is None else
                 f"{_times(r[c]['ratio'])} ({r[c]['forwards_per_sample']:.2f} fwd)"
                 for c in columns]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['noadapt_ms']:.3f} | "
                     f"{' | '.join(cells)} | {_times(r.get('served_ratio'))} |")
    return lines


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def markdown(costs: list[dict[str, Any]], memory: list[dict[str, Any]],
             budgets: list[dict[str, Any]] = (), layers: list[dict[str, Any]] = ()) -> str:
    """The cost, memory, budget and recommended-layers tables (those with rows), one blank
    line apart."""
    tables = [t for t in (_cost_markdown(costs), _memory_markdown(memory),
                          _budget_markdown(list(budgets)) if budgets else [],
                          _cost_markdown(list(layers))) if t]
    return "\n\n".join("\n".join(t) for t in tables)


def _cost_markdown(costs: list[dict[str, Any]]) -> list[str]:
    if not costs:
        return []
    names = [label for _, label in COST_COLUMNS]
    lines = [f"| model | B | NoAdapt ms / sample | {' | '.join(names)} | "
             "EVA-0 default outside ORT |", "|---" * (len(names) + 4) + "|"]
    for r in costs:
        share = r["eva0_split_outside_ort"]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['noadapt_ms']:.3f} | "
                     + " | ".join(_times(r[m]) for m, _ in COST_COLUMNS)
                     + f" | {'-' if share is None else f'{100 * share:.0f}%'} |")
    return lines


def _memory_markdown(memory: list[dict[str, Any]]) -> list[str]:
    if not memory:
        return []
    names = [label for _, label in MEMORY_COLUMNS]
    lines = [f"| model | B | NoAdapt GPU MiB load / peak | {' | '.join(names)} |",
             "|---" * (len(names) + 3) + "|"]
    for r in memory:
        cells = ["-" if r[m] is None else f"{r[m]['peak_mb']:.0f} ({_times(r[m]['ratio'])})"
                 for m, _ in MEMORY_COLUMNS]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['noadapt_load_mb']:.0f} / "
                     f"{r['noadapt_peak_mb']:.0f} | {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="gpu_check.sh's results folder")
    args = parser.parse_args(argv)
    costs, memory = cost_rows(args.results), memory_rows(args.results)
    budgets, layers = budget_rows(args.results), cost_rows(args.results, "layers")
    if not costs and not memory and not budgets and not layers:
        parser.error(f"no bench-*-cuda/cost.json, memory-*-cuda/cost.json, "
                     f"budget-*-cuda/cost.json or layers-*-cuda/cost.json under {args.results}")
    table = markdown(costs, memory, budgets, layers)
    print(table)
    write_outputs(args.results, "gpu", {"costs": costs, "memory": memory, "budgets": budgets,
                                        "layers": layers}, table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
