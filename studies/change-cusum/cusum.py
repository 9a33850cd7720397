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
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_images
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.runtime import inputwatch
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

OFF = (0.0, math.inf)
CANDIDATES = (OFF, (0.25, 16.0), (0.25, 24.0), (0.25, 32.0), (0.5, 12.0), (0.5, 16.0))
FAULTS = ("gauss-0.05", "gauss-0.1", "gauss-0.2", "gauss-0.3", "blur-1", "jpeg-20", "black")
MODELS = ("resnet_gn_fmnist", "vit_fmnist")
BATCHES = (1, 64)


def _name(candidate: tuple[float, float]) -> str:
    return "off" if candidate == OFF else f"k{candidate[0]}-h{candidate[1]:g}"


def _set(candidate: tuple[float, float]) -> None:
    inputwatch.CUSUM_K, inputwatch.CUSUM_H = candidate


def _calls(x: np.ndarray, batch: int, candidate: tuple[float, float]) -> list[int]:
    """The sample index after each batch whose observation called a change."""
    _set(candidate)
    detector = inputwatch.InputChangeDetector()
    return [i + len(x[i:i + batch]) for i in range(0, len(x), batch)
            if detector.observe(x[i:i + batch])]


def detector_table() -> str:
    """Per candidate and batch: the first call after each fault's return (clean images served
    before it; '-' not seen; calls before the return counted as early), the calls on the clean
    images in order and sorted by class, and per severity the changes of corruption seen (a
    call within 128 samples after one) and the calls elsewhere."""
    images, labels = load_fashion_mnist("train")
    _, val = train_val_indices(len(images))
    images, labels = np.asarray(images)[val], np.asarray(labels)[val]
    pre = read_metadata("models/vit_fmnist.onnx").preprocessing
    streams = {f: preprocess_uint8(np.concatenate(
        [hostile_images(f, images[:500], labels[:500], seed=0)[0], images[500:1000]]), pre)
        for f in FAULTS}
    clean = preprocess_uint8(images, pre)
    by_class = clean[np.argsort(labels, kind="stable")]
    continual = {s: preprocess_uint8(np.concatenate(
        [corrupt_images(images[k * 300:(k + 1) * 300], c, s, seed=0, start_index=k * 300)
         for k, c in enumerate(CORRUPTIONS)]), pre) for s in (1, 3, 5)}
    lines = ["| CUSUM | B | " + " | ".join(f"{f} return" for f in FAULTS)
             + " | clean 5000 | by class 5000 | "
             + " | ".join(f"sev {s} seen / other" for s in continual) + " |",
             "|---" * (4 + len(FAULTS) + len(continual)) + "|"]
    for candidate in CANDIDATES:
        for batch in BATCHES:
            cells = []
            for fault in FAULTS:
                calls = _calls(streams[fault], batch, candidate)
                after = [c - 500 for c in calls if c > 500]
                early = len(calls) - len(after)
                cells.append(f"{after[0] if after else '-'}" + (f" ({early} early)" if early
                                                                 else ""))
            cells.append(str(len(_calls(clean, batch, candidate))))
            cells.append(str(len(_calls(by_class, batch, candidate))))
            for x in continual.values():
                calls = _calls(x, batch, candidate)
                seen = {c // 300 for c in calls if 0 < c % 300 <= 128 and c > 300}
                cells.append(f"{len(seen)} / {len(calls) - len(seen)}")
            lines.append(f"| {_name(candidate)} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _eval(out: Path, model: str, candidate: tuple[float, float], args: list[str]) -> dict:
    """One ``eval`` run with the candidate CUSUM (kept under ``out``); its results."""
    if not (out / "results.json").is_file():
        code = ("import sys; import eva0_edge.runtime.inputwatch as w; "
                "w.CUSUM_K, w.CUSUM_H = float(sys.argv[1]), float(sys.argv[2]); "
                "from eva0_edge.cli import main; main(sys.argv[3:])")
        subprocess.run([sys.executable, "-c", code, str(candidate[0]), str(candidate[1]),
                        "eval", "--model", f"models/{model}.onnx", "--split", "val",
                        "--threads", "1", "--methods", "noadapt,eva0", *args, "--out",
                        str(out), "-q"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["results"]


def _row(results: dict, method: str, batch: int) -> dict:
    """A method's results at one batch size (an ``eval`` run of one batch size keys them by
    the method alone)."""
    return results.get(f"{method} B={batch}", results.get(method))


def accuracy_table(out: Path, candidates: list[tuple[float, float]]) -> str:
    """EVA-0 minus NoAdapt (points): on the clean half of each faulty-then-clean stream (batch
    1), and on the continual stream's average (batch 1 and 64), per model and candidate."""
    lines = ["| model | CUSUM | " + " | ".join(f"{f} then clean" for f in FAULTS)
             + " | continual sev 3 B 1 | continual sev 3 B 64 |",
             "|---" * (4 + len(FAULTS)) + "|"]
    for model in MODELS:
        for candidate in [OFF, *candidates]:
            name, cells = _name(candidate), []
            for fault in FAULTS:
                r = _eval(out / "runs" / f"{model}-{name}-{fault}", model, candidate, [
                    "--protocol", "continual", "--corruptions", f"{fault},clean",
                    "--limit", "500", "--batch-sizes", "1"])
                gain = _row(r, "eva0", 1)["accuracy"]["clean"] - \
                    _row(r, "noadapt", 1)["accuracy"]["clean"]
                cells.append(f"{gain:+.1f}")
            r = _eval(out / "runs" / f"{model}-{name}-continual3", model, candidate, [
                "--protocol", "continual", "--severity", "3", "--limit", "200",
                "--batch-sizes", "1,64"])
            for b in BATCHES:
                gain = _row(r, "eva0", b)["average"] - _row(r, "noadapt", b)["average"]
                cells.append(f"{gain:+.2f}")
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
    args.out.mkdir(parents=True, exist_ok=True)
    if "detector" in args.parts:
        table = detector_table()
        (args.out / "detector.md").write_text(table)
        print(table)
    if "accuracy" in args.parts:
        table = accuracy_table(args.out, [_parse(c) for c in args.accuracy.split(",")])
        (args.out / "accuracy.md").write_text(table)
        print(table)


if __name__ == "__main__":
    main()
