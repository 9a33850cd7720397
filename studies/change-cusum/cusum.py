"""A CUSUM beside the input change detector's window test, for mild returns (issue 50 item 9:
the ViT served 500 clean test images 2.0 points under NoAdapt after 500 with Gaussian noise of
sigma 0.1, a return whose largest z was 4.50, at the window test's threshold), on the
validation split only.

Part ``detector`` (no model run): where the detector calls a change with each candidate
CUSUM (allowance k, threshold h; ``off`` = the window test alone), on 500 faulty then 500 clean
validation images (Gaussian noise sigma 0.05-0.3, blur radius 1, JPEG quality 20, black), on
the 5000 clean validation images in order and sorted by class (runs of about 500 images of
one class: a label shift the images show, not a change of sensor), and on the 15-corruption
continual validation stream (300 images each) at severity 1, 3 and 5; batch 1 and 64.

Part ``accuracy``: the product's ``eval`` (EVA-0 and NoAdapt) on those faulty-then-clean
streams (batch 1) and on the continual stream at severity 3 (200 images per corruption, batch
1 and 64), without and with each ``--accuracy`` candidate, on both shipped models.

    python studies/change-cusum/cusum.py --out results/change-cusum

Writes ``detector.md`` and ``accuracy.md`` (and each ``eval`` run's report under ``runs/``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "change-threshold"))
from threshold import (  # noqa: E402 - the sibling study's helpers
    BATCHES,
    MODELS,
    accuracy_cells,
    detector_cells,
    run_eval,
    validation_streams,
    write_tables,
)

from eva0_edge.runtime import inputwatch  # noqa: E402

OFF = (0.0, math.inf)
CANDIDATES = (OFF, (0.25, 16.0), (0.25, 24.0), (0.25, 32.0), (0.5, 12.0), (0.5, 16.0))
FAULTS = ("gauss-0.05", "gauss-0.1", "gauss-0.2", "gauss-0.3", "blur-1", "jpeg-20", "black")


def _name(candidate: tuple[float, float]) -> str:
    return "off" if candidate == OFF else f"k{candidate[0]}-h{candidate[1]:g}"


def _calls(x: np.ndarray, batch: int, candidate: tuple[float, float]) -> list[int]:
    """The sample index after each batch whose observation called a change."""
    inputwatch.CUSUM_K, inputwatch.CUSUM_H = candidate
    detector = inputwatch.InputChangeDetector()
    return [i + len(x[i:i + batch]) for i in range(0, len(x), batch)
            if detector.observe(x[i:i + batch])]


def detector_table() -> str:
    """Per candidate and batch: the sibling study's detector cells, on the clean images in
    order and sorted by class too."""
    streams, clean, labels, continual = validation_streams(FAULTS)
    by_class = clean[np.argsort(labels, kind="stable")]
    lines = ["| CUSUM | B | " + " | ".join(f"{f} return" for f in FAULTS)
             + " | clean 5000 | by class 5000 | "
             + " | ".join(f"sev {s} seen / other" for s in continual) + " |",
             "|---" * (4 + len(FAULTS) + len(continual)) + "|"]
    for candidate in CANDIDATES:
        for batch in BATCHES:
            cells = detector_cells(lambda x, b=batch, c=candidate: _calls(x, b, c), streams,
                                   [clean, by_class], continual)
            lines.append(f"| {_name(candidate)} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def accuracy_table(out: Path, candidates: list[tuple[float, float]]) -> str:
    """The sibling study's accuracy cells per model and candidate."""
    lines = ["| model | CUSUM | " + " | ".join(f"{f} then clean" for f in FAULTS)
             + " | continual sev 3 B 1 | continual sev 3 B 64 |",
             "|---" * (4 + len(FAULTS)) + "|"]
    for model in MODELS:
        for candidate in [OFF, *candidates]:
            name = _name(candidate)
            setup = ("import eva0_edge.runtime.inputwatch as w; "
                     f"w.CUSUM_K, w.CUSUM_H = {candidate[0]}, float('{candidate[1]}')")
            cells = accuracy_cells(lambda run, args, m=model, s=setup, n=name:
                                   run_eval(out / "runs" / f"{m}-{n}-{run}", m, s, args), FAULTS)
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _parse(text: str) -> tuple[float, float]:
    k, h = text.split("/")
    return float(k), float(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="detector,accuracy")
    parser.add_argument("--accuracy", default="0.25/24", help="k/h candidates, comma separated")
    args = parser.parse_args()
    write_tables(args.out, args.parts, {
        "detector": detector_table,
        "accuracy": lambda: accuracy_table(args.out, [_parse(c) for c in
                                                      args.accuracy.split(",")])})


if __name__ == "__main__":
    main()
