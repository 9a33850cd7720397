"""The input change detector's threshold (``runtime.inputwatch.CHANGE_Z``) for mild returns
(issue 50 item 9: the ViT served 500 clean images 2.0 points under NoAdapt after 500 with
Gaussian noise of sigma 0.1, a return the detector did not call at z 4.5), on the validation
split only.

Part ``detector`` (no model run): where the detector calls a change at each candidate z, on
500 faulty then 500 clean validation images (Gaussian noise sigma 0.05-0.3, blur radius 1,
JPEG quality 20), on the 5000 clean validation images, and on the 15-corruption continual
validation stream (300 images each) at severity 1, 3 and 5; batch 1 and 64.

Part ``accuracy``: the product's ``eval`` (EVA-0 and NoAdapt, batch 1) on those
faulty-then-clean streams and on the continual stream at severity 3 (200 images per
corruption, batch 1 and 64), at z 4.5 and at each ``--accuracy-z``, on both shipped models
(the threshold set in the ``eval`` process before it runs).

    python studies/change-threshold/threshold.py --out results/change-threshold

Writes ``detector.md`` and ``accuracy.md`` (and each ``eval`` run's report under ``runs/``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_images
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.runtime import inputwatch
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

CANDIDATES = (4.5, 4.25, 4.0, 3.75)
FAULTS = ("gauss-0.05", "gauss-0.1", "gauss-0.2", "gauss-0.3", "blur-1", "jpeg-20")
MODELS = ("resnet_gn_fmnist", "vit_fmnist")
BATCHES = (1, 64)


def _calls(x: np.ndarray, batch: int, z: float) -> list[int]:
    """The sample index after each batch whose observation called a change, at threshold z."""
    inputwatch.CHANGE_Z = z
    detector = inputwatch.InputChangeDetector()
    return [i + len(x[i:i + batch]) for i in range(0, len(x), batch)
            if detector.observe(x[i:i + batch])]


def validation_streams(faults: tuple[str, ...]) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    """The validation streams (preprocessed for the shipped ViT, whose preprocessing both
    shipped models share): each fault's 500 faulty then 500 clean images, the 5000 clean
    images, their labels, and the continual stream (300 images per corruption) per severity."""
    images, labels = load_fashion_mnist("train")
    _, val = train_val_indices(len(images))
    images, labels = np.asarray(images)[val], np.asarray(labels)[val]
    pre = read_metadata("models/vit_fmnist.onnx").preprocessing
    streams = {f: preprocess_uint8(np.concatenate(
        [hostile_images(f, images[:500], labels[:500], seed=0)[0], images[500:1000]]), pre)
        for f in faults}
    continual = {s: preprocess_uint8(np.concatenate(
        [corrupt_images(images[k * 300:(k + 1) * 300], c, s, seed=0, start_index=k * 300)
         for k, c in enumerate(CORRUPTIONS)]), pre) for s in (1, 3, 5)}
    return streams, preprocess_uint8(images, pre), labels, continual


def detector_cells(calls: Callable[[np.ndarray], list[int]], streams: dict,
                   clean: list[np.ndarray], continual: dict) -> list[str]:
    """One detector's cells: the first call after each fault's return (clean images served
    before it; '-' not seen; calls before the return counted as early), the calls on each
    clean stream, and per severity the changes of corruption seen (a call within 128 samples
    after one) and the calls elsewhere."""
    cells = []
    for x in streams.values():
        called = calls(x)
        after = [c - 500 for c in called if c > 500]
        early = len(called) - len(after)
        cells.append(f"{after[0] if after else '-'}" + (f" ({early} early)" if early else ""))
    cells += [str(len(calls(x))) for x in clean]
    for x in continual.values():
        called = calls(x)
        seen = {c // 300 for c in called if 0 < c % 300 <= 128 and c > 300}
        cells.append(f"{len(seen)} / {len(called) - len(seen)}")
    return cells


def detector_table() -> str:
    """Per candidate z and batch: :func:`detector_cells` on the validation streams."""
    streams, clean, _, continual = validation_streams(FAULTS)
    lines = ["| z | B | " + " | ".join(f"{f} return" for f in FAULTS)
             + " | clean 5000 | " + " | ".join(f"sev {s} seen / other" for s in continual)
             + " |", "|---" * (3 + len(FAULTS) + len(continual)) + "|"]
    for z in CANDIDATES:
        for batch in BATCHES:
            cells = detector_cells(lambda x, b=batch, z=z: _calls(x, b, z), streams, [clean],
                                   continual)
            lines.append(f"| {z} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_eval(out: Path, model: str, setup: str, args: list[str]) -> dict:
    """One ``eval`` run on the validation split (kept under ``out``) in a process that first
    runs ``setup`` (Python: sets the detector's constants); its results."""
    if not (out / "results.json").is_file():
        code = f"{setup}; from eva0_edge.cli import main; import sys; main(sys.argv[1:])"
        subprocess.run([sys.executable, "-c", code, "eval", "--model", f"models/{model}.onnx",
                        "--split", "val", "--threads", "1", "--methods", "noadapt,eva0", *args,
                        "--out", str(out), "-q"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["results"]


def _eval(out: Path, model: str, z: float, args: list[str]) -> dict:
    """One ``eval`` run at threshold z."""
    return run_eval(out, model, f"import eva0_edge.runtime.inputwatch as w; w.CHANGE_Z = {z}",
                    args)


def _row(results: dict, method: str, batch: int) -> dict:
    """A method's results at one batch size (an ``eval`` run of one batch size keys them by
    the method alone)."""
    return results.get(f"{method} B={batch}", results.get(method))


def accuracy_cells(evaluate: Callable[[str, list[str]], dict],
                   faults: tuple[str, ...]) -> list[str]:
    """EVA-0 minus NoAdapt (points) of one model and detector, ``evaluate(run name, eval
    arguments)`` running it: on the clean half of each faulty-then-clean stream (batch 1), and
    on the continual stream's average (severity 3, batch 1 and 64)."""
    cells = []
    for fault in faults:
        r = evaluate(fault, ["--protocol", "continual", "--corruptions", f"{fault},clean",
                             "--limit", "500", "--batch-sizes", "1"])
        gain = _row(r, "eva0", 1)["accuracy"]["clean"] - _row(r, "noadapt", 1)["accuracy"]["clean"]
        cells.append(f"{gain:+.1f}")
    r = evaluate("continual3", ["--protocol", "continual", "--severity", "3", "--limit", "200",
                                "--batch-sizes", "1,64"])
    for b in BATCHES:
        cells.append(f"{_row(r, 'eva0', b)['average'] - _row(r, 'noadapt', b)['average']:+.2f}")
    return cells


def accuracy_table(out: Path, candidates: list[float]) -> str:
    """:func:`accuracy_cells` per model and z."""
    lines = ["| model | z | " + " | ".join(f"{f} then clean" for f in FAULTS)
             + " | continual sev 3 B 1 | continual sev 3 B 64 |",
             "|---" * (4 + len(FAULTS)) + "|"]
    for model in MODELS:
        for z in [4.5, *candidates]:
            cells = accuracy_cells(lambda run, args, m=model, z=z: _eval(
                out / "runs" / f"{m}-z{z}-{run}", m, z, args), FAULTS)
            lines.append(f"| {model} | {z} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="detector,accuracy")
    parser.add_argument("--accuracy-z", default="4.25")
    args = parser.parse_args()
    write_tables(args.out, args.parts, {
        "detector": detector_table,
        "accuracy": lambda: accuracy_table(args.out, [float(z) for z in
                                                      args.accuracy_z.split(",")])})


def write_tables(out: Path, parts: str, tables: dict[str, Callable[[], str]]) -> None:
    """Make each table named in ``parts`` (comma separated), write it to ``out/<name>.md`` and
    print it."""
    out.mkdir(parents=True, exist_ok=True)
    for name, make in tables.items():
        if name in parts.split(","):
            table = make()
            (out / f"{name}.md").write_text(table)
            print(table)


if __name__ == "__main__":
    main()
