"""Issue 49's budget targets over several seeds: the cells of several ``make pareto``
summaries (one ``BUDGET_SEED=S`` each: another image subset, stream order and perturbation
stream), per model, protocol, severity and batch size shared by all of them:

* ``1.5 - full``: EVA-0 at budget 1.5 less full-rate EVA-0, per seed, with the mean and its
  standard error (sample standard deviation / sqrt(seeds)); the target is mean >= -0.3;
* full rate's gain over the one-forward tier (``noadapt-shift``) and the share of it budget
  1.25 keeps, both from the means over seeds; the target is a share >= 0.5 (met trivially
  where the mean gain is not above 0 and 1.25 is not below the tier).

    python studies/budget-targets/seeds.py seed0=results/pareto/budget.json \
        out/pareto-seed*/budget.json --out results/pareto/seeds

A summary's column is named by ``NAME=`` before its path, or else by its folder. Prints a
Markdown table and writes ``<out>/seeds.md`` and ``seeds.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from targets import TOLERANCE_15, cells

from eva0_edge.bench.testbed.output import write_outputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "budget-seeds"))
from budget_seeds import _named  # noqa: E402 - the sibling study's NAME=PATH reading

METHODS = ("noadapt-shift", "eva0", "eva0 budget 1.5", "eva0 budget 1.25")


def _mean_error(values: list[float]) -> tuple[float, float | None]:
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), error


def seed_rows(summaries: dict[str, list[dict]]) -> list[dict]:
    """One row per cell (no bank) every summary holds with the four methods of ``METHODS``."""
    per_seed = [cells(rows) for rows in summaries.values()]
    shared = set.intersection(*(
        {key for key, methods in seed.items()
         if key[-1] == 0 and all(methods.get(m) for m in METHODS)} for seed in per_seed))
    out = []
    for key in sorted(shared):
        average = {m: [seed[key][m]["average"] for seed in per_seed] for m in METHODS}
        loss = [b - f for b, f in zip(average["eva0 budget 1.5"], average["eva0"], strict=True)]
        loss_mean, loss_error = _mean_error(loss)
        gain = statistics.fmean(average["eva0"]) - statistics.fmean(average["noadapt-shift"])
        kept = statistics.fmean(average["eva0 budget 1.25"]) - \
            statistics.fmean(average["noadapt-shift"])
        model, protocol, severity, batch, _ = key
        out.append({
            "model": model, "protocol": protocol, "severity": severity, "batch_size": batch,
            "seeds": len(per_seed), "means": {m: statistics.fmean(v) for m, v in average.items()},
            "loss_15": dict(zip(summaries, loss, strict=True)), "loss_15_mean": loss_mean,
            "loss_15_standard_error": loss_error, "ok_15": loss_mean >= -TOLERANCE_15,
            "gain": gain, "kept_125": kept,
            "ok_125": kept >= 0.5 * gain if gain > 0 else kept >= 0,
        })
    return out


def markdown(rows: list[dict], names: list[str]) -> str:
    lines = [f"| model | protocol | sev | B | tier | full | 1.5 | 1.25 | 1.5 - full: "
             f"{' | '.join(names)} | mean (SE) | 1.5 ok | gain | 1.25 kept | 1.25 ok |",
             "|---" * (13 + len(names)) + "|"]
    for r in rows:
        m = r["means"]
        each = " | ".join(f"{r['loss_15'][n]:+.2f}" for n in names)
        error = r["loss_15_standard_error"]
        share = f"{r['kept_125'] / r['gain']:.2f}" if r["gain"] > 0 else \
            f"gain {r['gain']:+.2f}"
        lines.append(
            f"| {r['model']} | {r['protocol']} | {r['severity']} | {r['batch_size']} | "
            f"{m['noadapt-shift']:.2f} | {m['eva0']:.2f} | {m['eva0 budget 1.5']:.2f} | "
            f"{m['eva0 budget 1.25']:.2f} | {each} | {r['loss_15_mean']:+.2f} "
            f"({'-' if error is None else f'{error:.2f}'}) | {'yes' if r['ok_15'] else 'NO'} | "
            f"{r['gain']:+.2f} | {share} | {'yes' if r['ok_125'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", help="[NAME=]budget.json of make pareto "
                        "runs with different seeds")
    parser.add_argument("--out", type=Path, required=True, help="folder for seeds.md / .json")
    args = parser.parse_args(argv)
    summaries, paths = {}, []
    for argument in args.summaries:
        name, path = _named(argument)
        paths.append(path)
        if name in summaries:
            parser.error(f"two summaries named {name!r}: {path}")
        try:
            summaries[name] = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError) as err:
            parser.error(f"{path}: not a budget summary ({err})")
    rows = seed_rows(summaries)
    if not rows:
        parser.error("no cell with the tier, full rate and budgets 1.5 and 1.25 in every summary")
    table = markdown(rows, list(summaries))
    print(table)
    write_outputs(args.out, "seeds", {"summaries": {n: str(p) for n, p in
                                                    zip(summaries, paths, strict=True)},
                                      "rows": rows}, table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
