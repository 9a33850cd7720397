"""What is left of issue 50 item 9's misses (the ViT served synchronously after Gaussian noise
of sigma 0.2: -1.2; asynchronously after sigma 0.05: -1.4; `served.md`): the same 500 clean
test images (500-999) after no fault at all, on the test split, measured only.

Part ``sync``: in process (``Policy.step`` one image at a time, the synchronous server's path
at one image per request: the ViT after sigma 0.2 reads 88.0 here and in `served.md`), EVA-0
and NoAdapt on each fault of `served.py` and on ``none`` (the 1000 clean images in order);
the clean half's accuracy, and of the images EVA-0 loses there against NoAdapt, how many it
loses on ``none`` too. Part ``async``: ``serve --async-adapt`` (a real server, one image per
request) repeated ``--repeats`` times after sigma 0.05 and after ``none`` (the asynchronous
server's passes depend on timing, so one run is one draw). With ``--whole`` instead: EVA-0
and NoAdapt on the whole clean test split in order (10000 images, one at a time), both models.

    python studies/change-cusum/residual.py --out results/change-cusum
    python studies/change-cusum/residual.py --whole --out results/change-cusum

Writes ``residual.md`` and ``residual.json`` (``--whole``: ``whole.md`` and ``whole.json``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from served import FAULTS, MODELS, clean_accuracy

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.output import write_outputs
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8

HALF = 500


def stream(fault: str, images: np.ndarray, labels: np.ndarray, model: str) -> np.ndarray:
    """500 images with ``fault`` (``none``: clean) then 500 clean ones, preprocessed."""
    first = images[:HALF] if fault == "none" else \
        hostile_images(fault, images[:HALF], labels[:HALF], seed=0)[0]
    pre = read_metadata(f"models/{model}.onnx").preprocessing
    return preprocess_uint8(np.concatenate([first, images[HALF:]]), pre)


def one_at_a_time(model: str, method: str, x: np.ndarray) -> np.ndarray:
    """Predicted class per image, ``Policy.step`` on one image at a time."""
    policy = Policy.load(f"models/{model}.onnx", method, threads=1)
    return np.array([policy.step(x[i : i + 1]).argmax(1)[0] for i in range(len(x))])


def whole(out: Path) -> None:
    """EVA-0 and NoAdapt on the 10000 clean test images in order, one at a time."""
    images, labels = load_fashion_mnist("test")
    labels = np.asarray(labels)
    lines = ["| model | images | NoAdapt | EVA-0 | EVA-0 - NoAdapt | lost / won |",
             "|---" * 6 + "|"]
    rows = []
    for model in MODELS:
        x = preprocess_uint8(np.asarray(images),
                             read_metadata(f"models/{model}.onnx").preprocessing)
        pred = {m: one_at_a_time(model, m, x) for m in ("noadapt", "eva0")}
        base, eva = (100.0 * float((pred[m] == labels).mean()) for m in ("noadapt", "eva0"))
        lost = int(((pred["noadapt"] == labels) & (pred["eva0"] != labels)).sum())
        won = int(((pred["noadapt"] != labels) & (pred["eva0"] == labels)).sum())
        rows.append({"model": model, "images": len(x), "noadapt": base, "eva0": eva,
                     "lost": lost, "won": won})
        lines.append(f"| {model} | {len(x)} | {base:.2f} | {eva:.2f} | {eva - base:+.2f} | "
                     f"{lost} / {won} |")
        print(lines[-1], flush=True)
    write_outputs(out, "whole", {"rows": rows}, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    if args.whole:
        whole(args.out)
        return
    images, labels = load_fashion_mnist("test")
    images, labels = np.asarray(images)[: 2 * HALF], np.asarray(labels)[: 2 * HALF]
    clean = labels[HALF:]
    report: dict = {"environment_start": environment(), "sync": [], "async": []}
    lines = ["| model | fault | NoAdapt | EVA-0 | EVA-0 - NoAdapt | images lost (net) | "
             "lost after `none` too |", "|---" * 7 + "|"]
    for model in MODELS:
        served = {}
        for fault in ("none", *FAULTS):
            x = stream(fault, images, labels, model)
            served[fault] = {m: one_at_a_time(model, m, x)[HALF:] for m in ("noadapt", "eva0")}
        lost_none = set(np.flatnonzero((served["none"]["noadapt"] == clean)
                                       & (served["none"]["eva0"] != clean)))
        for fault, pred in served.items():
            base, eva = (100.0 * float((pred[m] == clean).mean()) for m in ("noadapt", "eva0"))
            lost = np.flatnonzero((pred["noadapt"] == clean) & (pred["eva0"] != clean))
            won = np.flatnonzero((pred["noadapt"] != clean) & (pred["eva0"] == clean))
            also = len(lost_none.intersection(lost))
            report["sync"].append({"model": model, "fault": fault, "noadapt": base, "eva0": eva,
                                   "lost": len(lost), "won": len(won), "lost_after_none": also})
            lines.append(f"| {model} | {fault} | {base:.1f} | {eva:.1f} | {eva - base:+.1f} | "
                         f"{len(lost) - len(won)} ({len(lost)} - {len(won)}) | {also} |")
            print(lines[-1], flush=True)
    lines += ["", "| model | fault | run | NoAdapt | EVA-0 async | EVA-0 async - NoAdapt |",
              "|---" * 6 + "|"]
    model = "vit_fmnist"
    for fault in ("gauss-0.05", "none"):
        x = stream(fault, images, labels, model)
        base = clean_accuracy(model, "noadapt", (), x, labels)
        for run in range(args.repeats):
            eva = clean_accuracy(model, "eva0", ("--async-adapt",), x, labels)
            report["async"].append({"model": model, "fault": fault, "run": run,
                                    "noadapt": base, "eva0_async": eva})
            lines.append(f"| {model} | {fault} | {run} | {base:.1f} | {eva:.1f} | "
                         f"{eva - base:+.1f} |")
            print(lines[-1], flush=True)
    report["environment_end"] = environment()
    write_outputs(args.out, "residual", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
