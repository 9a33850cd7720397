"""Hostile-then-clean through a real server (issue 50 item 9's target, measured on the test
split, not used to choose): 500 faulty test images (0-499) then 500 clean ones (500-999), one
image per request, to ``eva0-edge serve`` with NoAdapt, EVA-0 (synchronous) and EVA-0
``--async-adapt``; the clean half's accuracy of each and its difference to NoAdapt's.

    python studies/change-cusum/served.py --out results/change-cusum

Writes ``served.md`` and ``served.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from eva0_edge.bench.serve_load import ServeProcess
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.bench.testbed.streams import serve_stream
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

FAULTS = ("gauss-0.05", "gauss-0.1", "gauss-0.2", "gauss-0.3", "blur-1", "jpeg-20", "black")
MODELS = ("resnet_gn_fmnist", "vit_fmnist")
SERVERS = (("noadapt", "noadapt", ()), ("eva0", "eva0", ()),
           ("eva0 async", "eva0", ("--async-adapt",)))


def clean_accuracy(model: str, method: str, extra: tuple[str, ...], x: np.ndarray,
                   labels: np.ndarray) -> float:
    """The served accuracy (%) on the stream's second half."""
    server = ServeProcess(f"models/{model}.onnx", method, 1, 10.0, "adaptive", 0, extra)
    try:
        predicted = serve_stream(server.url, model, x, 1)
    finally:
        server.stop()
    half = len(x) // 2
    return 100.0 * float((predicted[half:] == labels[half:]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    images, labels = load_fashion_mnist("test")
    images, labels = np.asarray(images)[:1000], np.asarray(labels)[:1000]
    report = {"environment_start": environment(), "rows": []}
    lines = ["| model | fault | NoAdapt | EVA-0 sync | EVA-0 async | sync - NoAdapt | "
             "async - NoAdapt |", "|---" * 7 + "|"]
    for model in MODELS:
        pre = read_metadata(f"models/{model}.onnx").preprocessing
        for fault in FAULTS:
            x = preprocess_uint8(np.concatenate(
                [hostile_images(fault, images[:500], labels[:500], seed=0)[0],
                 images[500:]]), pre)
            row = {label: clean_accuracy(model, method, extra, x, labels)
                   for label, method, extra in SERVERS}
            report["rows"].append({"model": model, "fault": fault, **row})
            base = row["noadapt"]
            lines.append(f"| {model} | {fault} | {base:.1f} | {row['eva0']:.1f} | "
                         f"{row['eva0 async']:.1f} | {row['eva0'] - base:+.1f} | "
                         f"{row['eva0 async'] - base:+.1f} |")
            print(lines[-1], flush=True)
    report["environment_end"] = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "served.md").write_text("\n".join(lines) + "\n")
    (args.out / "served.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
