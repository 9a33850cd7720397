"""The hostile protocol's table (``make hostile``): for each model and hostile stream, the
accuracy on the stream and on the clean images after it, NoAdapt against EVA-0, from the
per-stream reports ``<reports>/<model>-<stream>[-seed<S>]/results.json``. Reports of the same
model and stream at several seeds (``make hostile HOSTILE_SEEDS="0 1 2"``: the seed orders the
stream and draws the perturbations) make one row: the mean over the seeds, and the worst
seed's clean gap beside the mean one (500 clean images: one image is 0.2 points, and which
images a run happens to lose moves the gap by a point). Where the reports keep their traces
(``traces.npz``, batch 1) the two methods are compared image by image: the gap's standard
error (McNemar's, from the images only one of them classifies right; over the seeds,
sqrt(sum SE^2) / seeds) and where EVA-0's net losses fall, in the first ``EARLY`` (50) clean
images after the hostile stream or later.

    python -m eva0_edge.bench.hostile_summary out/hostile

Prints a Markdown table and writes ``<reports>/hostile.md`` and ``hostile.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .testbed.datasets import CLEAN
from .testbed.report import paired_gap, read_traces

EARLY = 50  # clean images right after the hostile stream, where a lagging adapter would lose


def paired_clean(traces_path: Path) -> dict[str, Any] | None:
    """EVA-0 against NoAdapt image by image on the clean images of one batch-1 run: the gap's
    standard error (points) and EVA-0's net losses (images NoAdapt alone gets right minus those
    EVA-0 alone gets right) in the first :data:`EARLY` clean images and after; None when the
    traces are missing or not per image."""
    if not traces_path.is_file():
        return None
    traces = read_traces(traces_path)
    hits = {}
    for method in ("noadapt", "eva0"):
        trace = traces.get(method)
        if trace is None or np.any(trace["batch_size"] != 1):
            return None
        hits[method] = trace["batch_correct"][trace["batch_domain"] == CLEAN].astype(bool)
    noadapt, eva0 = hits["noadapt"], hits["eva0"]
    if len(noadapt) != len(eva0) or not len(eva0):
        return None
    lost = noadapt & ~eva0
    won = eva0 & ~noadapt
    return {"clean_gap_se": round(paired_gap(eva0, noadapt)[1], 2),
            "net_lost_early": int(lost[:EARLY].sum() - won[:EARLY].sum()),
            "net_lost_later": int(lost[EARLY:].sum() - won[EARLY:].sum())}


def runs(reports: Path) -> list[dict[str, Any]]:
    """One row per report folder: model, stream, seed, NoAdapt and EVA-0 on the stream and on
    clean (%, None for an unlabelled stream), the clean gap and EVA-0's guard trips."""
    rows = []
    for path in sorted(reports.glob("*/results.json")):
        report = json.loads(path.read_text())
        config, results = report["spec"], report["results"]
        stream = next(d for d in results["noadapt"]["accuracy"] if d != CLEAN)

        def score(method: str, domain: str, results: dict = results) -> float | None:
            value = results[method]["accuracy"][domain]
            return None if value is None or math.isnan(value) else round(value, 1)

        guard = (results["eva0"].get("final_stats") or {}).get("guard") or {}
        rows.append({
            "model": Path(config["model"]).stem, "stream": stream, "seed": config.get("seed", 0),
            "noadapt_stream": score("noadapt", stream), "eva0_stream": score("eva0", stream),
            "noadapt_clean": score("noadapt", CLEAN), "eva0_clean": score("eva0", CLEAN),
            "clean_gap": round(results["eva0"]["accuracy"][CLEAN]
                               - results["noadapt"]["accuracy"][CLEAN], 1),
            "trips": guard.get("trips"), "audits": guard.get("audits"),
            "images_per_domain": config.get("limit"), "batch_size": config.get("batch_size"),
            **(paired_clean(path.parent / "traces.npz") or {}),
        })
    return rows


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 1) + 0.0 if known else None  # no "-0.0"


def summarise(reports: Path) -> list[dict[str, Any]]:
    """One row per model and stream: the runs' values averaged over their seeds (trips and
    audits summed), ``worst_gap`` the lowest seed's clean gap, ``seeds`` how many; with every
    run's traces, ``gap_se`` the mean gap's standard error and ``net_lost_early`` /
    ``net_lost_later`` EVA-0's net losses summed over the seeds (None without)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs(reports):
        groups.setdefault((run["model"], run["stream"]), []).append(run)
    rows = []
    for (model, stream), group in groups.items():
        row: dict[str, Any] = {"model": model, "stream": stream}
        for key in ("noadapt_stream", "eva0_stream", "noadapt_clean", "eva0_clean", "clean_gap"):
            row[key] = _mean([r[key] for r in group])
        row["worst_gap"] = min(r["clean_gap"] for r in group)
        paired = all("clean_gap_se" in r for r in group)
        row["gap_se"] = (round(math.sqrt(sum(r["clean_gap_se"] ** 2 for r in group))
                               / len(group), 2) if paired else None)
        for key in ("net_lost_early", "net_lost_later"):
            row[key] = sum(r[key] for r in group) if paired else None
        for key in ("trips", "audits"):
            counts = [r[key] for r in group if r[key] is not None]
            row[key] = sum(counts) if counts else None
        row["seeds"] = sorted(r["seed"] for r in group)
        row["images_per_domain"] = group[0]["images_per_domain"]
        row["batch_size"] = group[0]["batch_size"]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["| model | stream | NoAdapt stream | EVA-0 stream | NoAdapt clean after | "
             "EVA-0 clean after | gap | gap SE | worst gap | net lost, first "
             f"{EARLY} / later | seeds | trips | audits |", "|---" * 13 + "|"]
    for r in rows:
        values = [r[k] for k in ("model", "stream", "noadapt_stream", "eva0_stream",
                                 "noadapt_clean", "eva0_clean", "clean_gap")]
        values += [None if r.get("gap_se") is None else f"{r['gap_se']:.2f}", r["worst_gap"]]
        early, later = r.get("net_lost_early"), r.get("net_lost_later")
        values += [None if early is None else f"{early} / {later}", len(r["seeds"]),
                   r["trips"], r["audits"]]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", help="the folder of per-stream reports (make hostile: "
                        "out/hostile)")
    args = parser.parse_args(argv)
    reports = Path(args.reports)
    rows = summarise(reports)
    if not rows:
        parser.error(f"no <model>-<stream>/results.json under {reports}")
    table = markdown(rows)
    print(table)
    (reports / "hostile.md").write_text(table + "\n")
    (reports / "hostile.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
