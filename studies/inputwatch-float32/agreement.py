"""Whether the float32 descriptors call the same changes as the float64 ones they replaced: the
input change detector run both ways over the streams the product's tables read (the continual
test stream, severity 5, 1000 images per corruption; the validation one, 500 per corruption;
10000 clean test images; each hostile stream and sensor fault, 500 images then 500 clean ones),
at batch 1, 16 and 64. Prints, per stream and batch, the samples after which each detector
called a change and whether they agree, then the largest descriptor difference, the largest
difference of a batch's z^2 where it is under twice the threshold, and the least distance of a
float64 z^2 from the threshold. Run from the repository root:

    python studies/inputwatch-float32/agreement.py
"""

from unittest import mock

import numpy as np

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS
from eva0_edge.bench.testbed.datasets import TEST_SEED, VALIDATION_SEED, corrupted_fmnist
from eva0_edge.bench.testbed.hostile import HOSTILE, NOISE_SWEEP
from eva0_edge.runtime import inputwatch
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8

PRE = read_metadata("models/resnet_gn_fmnist.onnx").preprocessing
BATCHES = (1, 16, 64)


def float64_describe(x: np.ndarray) -> np.ndarray:
    """The descriptors as computed before (32 x 32 images: stride 1, float64 sums)."""
    axes, f64 = (1, 2, 3), np.float64
    variance = x.var(axes, dtype=f64)
    edges = (np.diff(x, axis=3) ** 2).mean(axes, dtype=f64) + \
        (np.diff(x, axis=2) ** 2).mean(axes, dtype=f64)
    return np.stack([x.mean(axes, dtype=f64), np.log(variance + 1e-6),
                     np.log((edges + 1e-6) / (variance + 1e-6))], axis=1)


def images(split: str, name: str, stop: int, start: int = 0) -> np.ndarray:
    seed = TEST_SEED if split == "test" else VALIDATION_SEED
    x, _ = corrupted_fmnist(split, name, 5, seed,
                            indices=np.arange(start, stop), progress=False)
    return preprocess_uint8(x, PRE)


def changes(x: np.ndarray, batch: int) -> tuple[list[int], np.ndarray]:
    """The samples after which a change is called, x fed ``batch`` at a time, and each
    batch's largest z^2 (NaN while the windows fill)."""
    detector = inputwatch.InputChangeDetector()
    called, z_squared = [], []
    for i in range(0, len(x), batch):
        if detector.observe(x[i:i + batch]):
            called.append(i + len(x[i:i + batch]))
        z_squared.append(np.nan if detector.last_z_squared is None else detector.last_z_squared)
    return called, np.array(z_squared)


def streams() -> dict[str, np.ndarray]:
    out = {
        "test continual": np.concatenate([images("test", c, 1000) for c in CORRUPTIONS]),
        "val continual": np.concatenate([images("val", c, 500) for c in CORRUPTIONS]),
        "test clean": images("test", "clean", 10000),
    }
    for name in (*HOSTILE, *NOISE_SWEEP):
        out[f"{name} then clean"] = np.concatenate(
            [images("test", name, 500), images("test", "clean", 1000, 500)])
    return out


def main() -> None:
    worst, margin, z_gap, disagree = 0.0, np.inf, 0.0, 0
    threshold = inputwatch.CHANGE_Z**2
    for name, x in streams().items():
        worst = max(worst, float(np.abs(inputwatch.describe(x) - float64_describe(x)).max()))
        for batch in BATCHES:
            now, z_now = changes(x, batch)
            with mock.patch.object(inputwatch, "describe", float64_describe):
                before, z_before = changes(x, batch)
            disagree += now != before
            margin = min(margin, float(np.nanmin(np.abs(z_before - threshold))))
            near = np.abs(z_before - threshold) < threshold  # z^2 within 0-40.5
            if now == before and near.any():
                z_gap = max(z_gap, float(np.abs(z_now - z_before)[near].max()))
            print(f"{name:24s} B{batch:<3d} float32 {now} float64 {before} "
                  f"{'same' if now == before else 'DIFFERENT'}")
    print(f"largest descriptor difference {worst:.2e}; largest z^2 difference "
          f"where z^2 < {2 * threshold} {z_gap:.2e}; "
          f"least |z^2 - {threshold}| (float64) {margin:.3g}; stream-batch pairs that differ: "
          f"{disagree}")


if __name__ == "__main__":
    main()
