"""Does an input change detector that compares each image with images of its own predicted
class stop calling changes at the class boundaries of a label-sorted stream, and still see the
changes of corruption? Issue 49's open item: on ``imbalanced`` streams (each corruption's
images sorted by class) the input change detector calls a change at most class boundaries (27
in a 300-image domain of the BatchNorm model's validation stream), each call restarts the
activation shift's windows and starts a guard audit, and full-rate EVA-0 reads 2-3 points
under the one-forward tier. Offline, on the validation split only; no engine change.

Two detectors, one image at a time (batch 1), on the ViT's preprocessing:

* ``today``: :class:`eva0_edge.runtime.inputwatch.InputChangeDetector` as it ships (the window
  test and the CUSUM on the three descriptors);
* ``per class W/M``: the same two tests on each image's descriptors standardised by the windows
  of its predicted class (theta0's prediction, NoAdapt's: a stand-in for the served one): per
  class a window of W samples' mean and mean square, taken before the image; an image whose
  class window holds under M samples' weight is only added to it (``--candidates``). The
  residual's recent window (32) is tested at z 4.5 against 0 with variance 1, and its CUSUM at
  k 0.25, h 24 with deviations clipped to 3, both as ``today``'s; every window restarts at a
  call.

Streams (validation images): the 5000 clean ones in order and sorted by class; the
15-corruption continual stream (300 images per corruption) at severity 1, 3 and 5, in order
and with each corruption's images sorted by class (the ``imbalanced`` order, without its
resets: a change of corruption must still be seen); 500 noisy (sigma 0.1, 0.2), blurred or
JPEG-20 images then 500 clean ones.

    python studies/class-conditional-detector/study.py --out results/class-conditional-detector
    python studies/class-conditional-detector/study.py --accuracy \
        --out results/class-conditional-detector

Writes ``detector.md`` and ``detector.json``. With ``--accuracy`` instead: the most a detector
that never calls a change at a label run could gain there, as the product's ``eval`` on the
validation split's ``imbalanced`` protocol (severity 1 and 3, 300 images per corruption, batch
16; NoAdapt, the one-forward tier and EVA-0) with the input change detector as it ships and
with its calls off (z and h infinite): ``accuracy.md`` (each run's report under ``runs/``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_images
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from eva0_edge.bench.testbed.hostile import hostile_images
from eva0_edge.bench.testbed.output import write_outputs
from eva0_edge.runtime import inputwatch
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from eva0_edge.runtime.rates import window_factor, windowed_update

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "change-threshold"))
from threshold import run_eval  # noqa: E402 - the sibling study's helper

MODEL = "models/vit_fmnist.onnx"
CLASSES = 10
CANDIDATES = ((64, 16), (128, 16), (128, 32), (256, 32))
DOMAIN = 300
FAULTS = ("gauss-0.1", "gauss-0.2", "blur-1", "jpeg-20")


class PerClassDetector:
    """The window test and the CUSUM of :mod:`eva0_edge.runtime.inputwatch` on descriptors
    standardised by their predicted class's window (see the module's docstring)."""

    def __init__(self, class_samples: int, min_class_samples: int) -> None:
        self.class_factor = window_factor(class_samples)
        self.min_class_samples = min_class_samples
        self.recent_factor = window_factor(inputwatch.RECENT_SAMPLES)
        self.restart()

    def restart(self) -> None:
        self.moments = np.zeros((CLASSES, 2 * len(inputwatch.DESCRIPTORS)))
        self.weights = np.zeros(CLASSES)
        self.recent, self.recent_weight = np.zeros(len(inputwatch.DESCRIPTORS)), 0.0
        self.cusum = np.zeros(2 * len(inputwatch.DESCRIPTORS))

    def observe(self, values: np.ndarray, label: int) -> bool:
        """One image's descriptors [3] and predicted class; whether a change is called."""
        width = len(values)
        weight = self.weights[label]
        changed = False
        if weight >= 1.0 - self.class_factor**self.min_class_samples:
            mean = self.moments[label, :width]
            variance = np.maximum(self.moments[label, width:] - mean**2, 0.0) + 1e-8
            residual = (values - mean) / np.sqrt(variance)
            self.recent, self.recent_weight = windowed_update(
                self.recent, self.recent_weight, residual[None], self.recent_factor)
            full = 1.0 - self.recent_factor**inputwatch.RECENT_SAMPLES
            if self.recent_weight >= full:
                changed = float((self.recent**2).max()) * inputwatch.RECENT_SAMPLES > \
                    inputwatch.CHANGE_Z**2
            step = np.clip(residual, -inputwatch.CUSUM_CLIP, inputwatch.CUSUM_CLIP)
            self.cusum = np.maximum(self.cusum + np.concatenate([step, -step])
                                    - inputwatch.CUSUM_K, 0.0)
            changed |= bool(self.cusum.max() > inputwatch.CUSUM_H)
        self.moments[label], self.weights[label] = windowed_update(
            self.moments[label], weight, np.concatenate([values, values**2])[None],
            self.class_factor)
        if changed:
            self.restart()
        return changed


def detector_names(candidates: list[tuple[int, int]]) -> list[str]:
    return ["today", *(f"per class {w}/{m}" for w, m in candidates)]


def calls(x: np.ndarray, labels: np.ndarray,
          candidates: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Each detector's calls on x [N, C, H, W] (the sample index after the calling image)."""
    today = inputwatch.InputChangeDetector()
    per_class = [PerClassDetector(w, m) for w, m in candidates]
    values = inputwatch.describe(x)
    names = detector_names(candidates)
    out: dict[str, list[int]] = {name: [] for name in names}
    for i in range(len(x)):
        if today.observe(x[i:i + 1]):
            out["today"].append(i + 1)
        for name, detector in zip(names[1:], per_class, strict=True):
            if detector.observe(values[i], int(labels[i])):
                out[name].append(i + 1)
    return out


def sorted_by_class(labels: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The indices start..stop-1 ordered by label (stable)."""
    return start + np.argsort(labels[start:stop], kind="stable")


OFF = ("import eva0_edge.runtime.inputwatch as w; w.CHANGE_Z = float('inf'); "
       "w.CUSUM_H = float('inf')")
ACCURACY_MODELS = ("mobilenet_bn_fmnist", "vit_fmnist")


def accuracy(out: Path) -> None:
    """``eval`` on the imbalanced validation protocol with the detector's calls on and off."""
    args = ["--protocol", "imbalanced", "--severity", "1,3", "--limit", "300",
            "--batch-sizes", "16", "--methods", "noadapt,noadapt-shift,eva0"]
    lines = ["| model | sev | NoAdapt | tier | EVA-0, detector as shipped | EVA-0, no calls |",
             "|---|---|---|---|---|---|"]
    rows = []
    for model in ACCURACY_MODELS:
        on = run_eval(out / "runs" / f"{model}-on", model, "pass", args)
        off = run_eval(out / "runs" / f"{model}-off", model, OFF, args)
        for severity in ("1", "3"):
            read = {(name, method): float(results[f"{method} S={severity}"]["average"])
                    for name, results in (("on", on), ("off", off))
                    for method in ("noadapt", "noadapt-shift", "eva0")}
            rows.append({"model": model, "severity": int(severity),
                         **{f"{method} ({name})": value for (name, method), value in read.items()}})
            lines.append(f"| {model} | {severity} | {read['on', 'noadapt']:.2f} | "
                         f"{read['on', 'noadapt-shift']:.2f} | {read['on', 'eva0']:.2f} | "
                         f"{read['off', 'eva0']:.2f} |")
    write_outputs(out, "accuracy", {"rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--candidates", default=",".join(f"{w}/{m}" for w, m in CANDIDATES),
                        help="per-class window / warm-up pairs, comma-separated")
    parser.add_argument("--accuracy", action="store_true")
    args = parser.parse_args()
    if args.accuracy:
        args.out.mkdir(parents=True, exist_ok=True)
        accuracy(args.out)
        return
    candidates = [tuple(int(v) for v in c.split("/")) for c in args.candidates.split(",")]
    images, labels = load_fashion_mnist("train")
    _, val = train_val_indices(len(images))
    images, labels = np.asarray(images)[val], np.asarray(labels)[val]
    pre = read_metadata(MODEL).preprocessing
    noadapt = Policy.load(MODEL, "noadapt", threads=1)

    def predicted(x: np.ndarray) -> np.ndarray:
        return np.concatenate([noadapt.predict(x[i:i + 256]).argmax(1)
                               for i in range(0, len(x), 256)])

    rows = []
    clean = preprocess_uint8(images, pre)
    order = np.argsort(labels, kind="stable")
    for name, x in (("clean 5000", clean), ("clean 5000 sorted by class", clean[order])):
        found = calls(x, predicted(x), candidates)
        rows.append({"stream": name, **{k: {"calls": len(v)} for k, v in found.items()}})
    for severity in (1, 3, 5):
        continual = preprocess_uint8(np.concatenate(
            [corrupt_images(images[k * DOMAIN:(k + 1) * DOMAIN], c, severity, seed=0,
                            start_index=k * DOMAIN) for k, c in enumerate(CORRUPTIONS)]), pre)
        n = len(CORRUPTIONS) * DOMAIN
        sorted_order = np.concatenate([sorted_by_class(labels[:n], k * DOMAIN, (k + 1) * DOMAIN)
                                       for k in range(len(CORRUPTIONS))])
        for kind, x in (("in order", continual), ("sorted by class", continual[sorted_order])):
            found = calls(x, predicted(x), candidates)
            cells = {}
            for detector, called in found.items():
                seen = {c // DOMAIN for c in called if 0 < c % DOMAIN <= 128 and c > DOMAIN}
                cells[detector] = {"calls": len(called), "changes_seen": len(seen),
                                   "other_calls": len(called) - len(seen)}
            rows.append({"stream": f"continual severity {severity}, {kind}", **cells})
    for fault in FAULTS:
        x = preprocess_uint8(np.concatenate(
            [hostile_images(fault, images[:500], labels[:500], seed=0)[0], images[500:1000]]),
            pre)
        found = calls(x, predicted(x), candidates)
        cells = {}
        for detector, called in found.items():
            after = [c - 500 for c in called if c > 500]
            cells[detector] = {"calls": len(called), "return_seen_after": after[0] if after
                               else None, "early_calls": len(called) - len(after)}
        rows.append({"stream": f"{fault} then clean", **cells})
    names = detector_names(candidates)
    lines = ["| stream | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for row in rows:
        cells = []
        for name in names:
            r = row[name]
            if "changes_seen" in r:
                cells.append(f"{r['changes_seen']} seen / {r['other_calls']} other")
            elif "return_seen_after" in r:
                seen = "-" if r["return_seen_after"] is None else r["return_seen_after"]
                cells.append(f"{seen} ({r['calls']} calls)")
            else:
                cells.append(f"{r['calls']} calls")
        lines.append(f"| {row['stream']} | " + " | ".join(cells) + " |")
    write_outputs(args.out, "detector", {"candidates": candidates, "rows": rows},
                  "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
