"""A budget's cost in accuracy over several seeds: for every model, batch size and budget row
that a set of ``budget.json`` summaries (one ``make budget BUDGET_SEED=S`` each) share with the
full-cost reference, the difference ``budget - reference`` (accuracy points) in each, their
mean and the standard error of that mean (sample standard deviation / sqrt(seeds)).

    python studies/budget-seeds/budget_seeds.py seed0=results/budget/budget.json \
        results/budget-seeds/seed*/budget.json --out results/budget-seeds

A summary's column is named by ``NAME=`` before its path, or else by its folder (``seed1``).

One seed moves a continual run's average by about half a point (another image subset, stream
order and perturbation stream), so a target on the difference is read from the mean and its
error, not from one run. Prints a Markdown table and writes ``<out>/seeds.md`` and
``seeds.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from eva0_edge.bench.testbed.output import write_outputs


def differences(summaries: dict[str, list[dict[str, Any]]], reference: str = "eva0",
                ) -> list[dict[str, Any]]:
    """One row per (model, batch size, budget method) present, with ``reference``, in every
    summary (name -> its rows): the per-summary differences (points), their mean and
    standard error (None for one summary) and the measured forwards per sample's mean."""
    keyed = [{(r["model"], r["batch_size"], r["method"]): r for r in rows}
             for rows in summaries.values()]
    shared = set.intersection(*(set(k) for k in keyed))
    out = []
    for model, batch, method in sorted(shared):
        if not method.startswith(f"{reference} budget ") or (model, batch, reference) not in shared:
            continue
        gaps = [k[model, batch, method]["average"] - k[model, batch, reference]["average"]
                for k in keyed]
        mean = statistics.fmean(gaps)
        error = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
        forwards = statistics.fmean(k[model, batch, method]["forwards_per_sample"] for k in keyed)
        out.append({"model": model, "batch_size": batch, "method": method,
                    "reference": reference, "differences": dict(zip(summaries, gaps, strict=True)),
                    "mean": mean, "standard_error": error, "forwards_per_sample": forwards})
    return out


def markdown(rows: list[dict[str, Any]], names: list[str]) -> str:
    lines = [f"| model | B | method | fwd/sample | {' | '.join(names)} | mean (SE) |",
             "|---" * (5 + len(names)) + "|"]
    for r in rows:
        each = " | ".join(f"{r['differences'][n]:+.2f}" for n in names)
        error = "-" if r["standard_error"] is None else f"{r['standard_error']:.2f}"
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['method']} | "
                     f"{r['forwards_per_sample']:.2f} | {each} | {r['mean']:+.2f} ({error}) |")
    return "\n".join(lines)


def _named(argument: str) -> tuple[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named by its folder) -> (column name, path)."""
    name, sep, path = argument.partition("=")
    if sep and "/" not in name:
        return name, Path(path)
    return Path(argument).parent.name, Path(argument)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", help="[NAME=]budget.json of make budget "
                        "runs with different seeds")
    parser.add_argument("--reference", default="eva0", help="the full-cost method")
    parser.add_argument("--out", type=Path, required=True, help="folder for seeds.md / .json")
    args = parser.parse_args(argv)
    summaries: dict[str, list[dict[str, Any]]] = {}
    paths = []
    for argument in args.summaries:
        name, path = _named(argument)
        if name in summaries:
            parser.error(f"two summaries named {name!r}: {path}")
        paths.append(str(path))
        try:
            summaries[name] = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError) as err:
            parser.error(f"{path}: not a budget summary ({err})")
    rows = differences(summaries, args.reference)
    if not rows:
        parser.error(f"no budget row shared, with {args.reference!r}, by every summary")
    table = markdown(rows, list(summaries))
    print(table)
    write_outputs(args.out, "seeds", {"reference": args.reference,
                                      "summaries": dict(zip(summaries, paths, strict=True)),
                                      "rows": rows}, table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
