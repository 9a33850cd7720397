"""The label-shift correction at batch 1 and 64: NoAdapt, the one-forward tier and EVA-0 with
``shift_prior_window`` at its default (on) and None (off), the product's ``eval`` on the
validation split at severity 3: ``continual`` (200 images per corruption, all 15) and
``imbalanced`` (class runs of 100 images: 1000 per corruption, four corruptions).

    python studies/label-shift/batch_check.py --out results/label-shift/batch-check

Keeps each run's report under ``--out`` (a run already there is not run again) and writes
``batch-check.md``: per model, protocol and batch size, the accuracy of each method and
setting and EVA-0's forwards per sample with the correction on.
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
SETTINGS = {"on": [], "off": ["--set", "shift_prior_window=None"]}
BATCHES = (1, 64)


def run(out: Path, model: str, protocol: str, setting: str) -> dict:
    """The ``results`` of one ``eval`` run (run once, kept under ``out``)."""
    folder = out / f"{model}-{protocol}-{setting}"
    if not (folder / "results.json").is_file():
        subprocess.run([
            sys.executable, "-m", "eva0_edge", "eval", "--model", f"models/{model}.onnx",
            "--protocol", protocol, "--severity", "3", "--split", "val",
            "--batch-sizes", ",".join(map(str, BATCHES)), "--threads", "1",
            "--methods", "noadapt,noadapt-shift,eva0", *PROTOCOLS[protocol],
            *SETTINGS[setting], "--out", str(folder), "-q"],
            check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / "results.json").read_text())["results"]


def _accuracy(results: dict, method: str, batch: int) -> str:
    """A method's mean accuracy (%) at one batch size, as the table prints it."""
    return f"{results[f'{method} B={batch}']['average']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    lines = ["| model | protocol | B | NoAdapt | tier off | tier on | EVA-0 off | EVA-0 on | "
             "EVA-0 fwd / sample on |", "|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for protocol in PROTOCOLS:
            on, off = (run(out, model, protocol, s) for s in ("on", "off"))
            for b in BATCHES:
                lines.append(
                    f"| {model} | {protocol} | {b} | {_accuracy(on, 'noadapt', b)} | "
                    f"{_accuracy(off, 'noadapt-shift', b)} | {_accuracy(on, 'noadapt-shift', b)} | "
                    f"{_accuracy(off, 'eva0', b)} | {_accuracy(on, 'eva0', b)} | "
                    f"{on[f'eva0 B={b}']['forwards_per_sample']:.2f} |")
    table = "\n".join(lines) + "\n"
    (out / "batch-check.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
