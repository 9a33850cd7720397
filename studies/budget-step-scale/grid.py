"""Does a larger step pay when a compute budget skips batches? (issue 49's lead from session 5)

Under a budget F < 2, EVA-0 adapts on a share of the batches (settled: (F - 1) of them); the
lead: eta x 2 at the adapted batches raised budget 1.25 on four validation cells. Here the
step is scaled by ``(1 / (F - 1)) ** p`` (p = 0: as shipped; p = 0.5: the square-root rule of
a noise-dominated step taken 1 / (F - 1) times less often; p = 1: the same total step), the
product's ``eval`` on the validation split, ``continual`` (300 images per corruption, the 15
in a row), batch 16, at budgets 1.25 and 1.5 and severities 1, 3 and 5, on the three shipped
models, with ``--set eta=`` the file's tuned eta times the scale.

    python studies/budget-step-scale/grid.py --out results/budget-step-scale

Keeps each run's results under ``--out/runs`` (a run there is not run again) and writes
``grid.md``: per model, budget and p, EVA-0's accuracy at each severity and its mean minus
p = 0's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eva0_edge.runtime.modelfile import read_metadata

MODELS = ("mobilenet_bn_fmnist", "resnet_gn_fmnist", "vit_fmnist")
BUDGETS = (1.25, 1.5)
POWERS = (0.0, 0.5, 1.0)
SEVERITIES = (1, 3, 5)


def run(out: Path, model: str, budget: float, power: float, severity: int) -> float:
    """EVA-0's mean accuracy (%) of one ``eval`` run (kept under ``out``)."""
    folder = out / "runs" / f"{model}-F{budget}-p{power}-s{severity}"
    if not (folder / "results.json").is_file():
        eta = read_metadata(f"models/{model}.onnx").tuned["eva0"]["eta"]
        scale = (1.0 / (budget - 1.0)) ** power
        subprocess.run([
            sys.executable, "-m", "eva0_edge", "eval", "--model", f"models/{model}.onnx",
            "--protocol", "continual", "--severity", str(severity), "--split", "val",
            "--limit", "300", "--batch-size", "16", "--threads", "1", "--methods", "eva0",
            "--budget", str(budget), "--set", f"eta={eta * scale:.6g}", "--out", str(folder),
            "-q"], check=True, stdout=subprocess.DEVNULL)
    results = json.loads((folder / "results.json").read_text())["results"]
    return float(results["eva0"]["average"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2)
    out = parser.parse_args().out
    cells = [(m, f, p, s) for m in MODELS for f in BUDGETS for p in POWERS for s in SEVERITIES]
    with ThreadPoolExecutor(parser.parse_args().jobs) as pool:
        accuracy = dict(zip(cells, pool.map(lambda c: run(out, *c), cells), strict=True))
    lines = ["| model | budget | p | " + " | ".join(f"sev {s}" for s in SEVERITIES)
             + " | mean | mean - p 0 |", "|---" * (5 + len(SEVERITIES)) + "|"]
    for m in MODELS:
        for f in BUDGETS:
            base = sum(accuracy[(m, f, 0.0, s)] for s in SEVERITIES) / len(SEVERITIES)
            for p in POWERS:
                row = [accuracy[(m, f, p, s)] for s in SEVERITIES]
                mean = sum(row) / len(row)
                lines.append(f"| {m} | {f} | {p} | " + " | ".join(f"{a:.2f}" for a in row)
                             + f" | {mean:.2f} | {mean - base:+.2f} |")
    table = "\n".join(lines) + "\n"
    (out / "grid.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
