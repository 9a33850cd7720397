"""The stream's class mix pi restarted at a change the input images show (a variant, not
kept): after 500 black or stuck frames the ResNet-GN served the clean images after them 0.5 /
0.7 points under NoAdapt (`make hostile`, five seeds, worst seed -2.0), where pi had learnt
the frames' one class. Restarting pi balanced at the input detector's change (as on a fresh
stream) is measured on the validation split (``continual`` and ``imbalanced``, severity 3,
batch 1 and 64, as ``batch_check.py``) and on the hostile streams it is meant for (test split,
measured only).

    python studies/label-shift/prior_restart.py --out results/label-shift/prior-restart

The variant is set in each ``eval`` process: when the input change detector calls a change,
the activation shift's restart that follows also empties pi. Writes ``prior-restart.md`` (and
each run's reports under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODELS = ("mobilenet_bn_fmnist", "resnet_gn_fmnist", "vit_fmnist")
PROTOCOLS = {"continual": ["--limit", "200"],
             "imbalanced": ["--limit", "1000", "--corruptions",
                            "gaussian_noise,snow,fog,contrast"]}
HOSTILE = ("black", "repeat")
SEEDS = (0, 1, 2, 3, 4)
VARIANT = """
import sys
import numpy as np
from eva0_edge.runtime import inputwatch, shift
if sys.argv[1] == "restart":
    seen = {"change": False}
    observe, restart = inputwatch.InputChangeDetector.observe, shift.ActivationShift.restart
    def watched(self, x):
        seen["change"] = changed = observe(self, x)
        return changed
    def restarted(self, state):
        restart(self, state)
        if seen["change"]:
            seen["change"] = False
            state.shift_prior = np.zeros(0)
    inputwatch.InputChangeDetector.observe = watched
    shift.ActivationShift.restart = restarted
from eva0_edge.cli import main
main(sys.argv[2:])
"""


def _eval(folder: Path, variant: str, args: list[str]) -> dict:
    """One ``eval`` run of the variant (``kept`` or ``restart``), run once, kept in folder."""
    if not (folder / "results.json").is_file():
        subprocess.run([sys.executable, "-c", VARIANT, variant, "eval", "--threads", "1",
                        *args, "--out", str(folder), "-q"], check=True,
                       stdout=subprocess.DEVNULL)
    return json.loads((folder / "results.json").read_text())["results"]


def validation_table(out: Path) -> str:
    lines = ["| model | protocol | B | NoAdapt | EVA-0, pi kept | EVA-0, pi restarted |",
             "|---|---|---|---|---|---|"]
    for model in MODELS:
        for protocol, extra in PROTOCOLS.items():
            runs = {v: _eval(out / "val" / f"{model}-{protocol}-{v}", v, [
                "--model", f"models/{model}.onnx", "--protocol", protocol, "--severity", "3",
                "--split", "val", "--batch-sizes", "1,64", "--methods", "noadapt,eva0",
                *extra]) for v in ("kept", "restart")}
            for b in (1, 64):
                acc = {v: r[f"eva0 B={b}"]["average"] for v, r in runs.items()}
                lines.append(f"| {model} | {protocol} | {b} | "
                             f"{runs['kept'][f'noadapt B={b}']['average']:.2f} | "
                             f"{acc['kept']:.2f} | {acc['restart']:.2f} |")
    return "\n".join(lines) + "\n"


def hostile_table(out: Path) -> str:
    lines = ["| model | stream | NoAdapt clean after | EVA-0, pi kept | EVA-0, pi restarted | "
             "worst seed kept / restarted |", "|---|---|---|---|---|---|"]
    for model in ("resnet_gn_fmnist", "vit_fmnist"):
        for stream in HOSTILE:
            clean: dict[str, list[float]] = {"noadapt": [], "kept": [], "restart": []}
            for seed in SEEDS:
                for v in ("kept", "restart"):
                    r = _eval(out / "hostile" / f"{model}-{stream}-seed{seed}-{v}", v, [
                        "--model", f"models/{model}.onnx", "--protocol", "continual",
                        "--corruptions", f"{stream},clean", "--batch-size", "1", "--limit",
                        "500", "--seed", str(seed), "--methods", "noadapt,eva0"])
                    clean[v].append(r["eva0"]["accuracy"]["clean"])
                clean["noadapt"].append(r["noadapt"]["accuracy"]["clean"])
            base = sum(clean["noadapt"]) / len(SEEDS)
            worst = {v: min(a - n for a, n in zip(clean[v], clean["noadapt"], strict=True))
                     for v in ("kept", "restart")}
            lines.append(f"| {model} | {stream} | {base:.1f} | "
                         f"{sum(clean['kept']) / len(SEEDS) - base:+.1f} | "
                         f"{sum(clean['restart']) / len(SEEDS) - base:+.1f} | "
                         f"{worst['kept']:+.1f} / {worst['restart']:+.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    text = ("Validation split, accuracy (%):\n\n" + validation_table(out)
            + "\nTest split, EVA-0 minus NoAdapt on the clean images after the stream (points, "
            "mean of five seeds):\n\n" + hostile_table(out))
    (out / "prior-restart.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
