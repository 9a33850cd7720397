"""Add the per-class source means of the classifier input (``head_input_class_means``, what the
activation shift's label-shift correction reads) to a shipped model file, from the calibration
images it was calibrated on (the training split's, ``CALIBRATION_IMAGES`` of them drawn with the
training log's seed): the file's other source statistics come out bit for bit as they were, or
nothing is written.

    python models/recipes/class_means.py --model models/resnet_gn_fmnist.onnx
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.fashion_mnist import (
    CALIBRATION_IMAGES,
    load_fashion_mnist,
    train_val_indices,
)
from eva0_edge.runtime.calibrate import source_statistics, write_source_stats
from eva0_edge.runtime.data import InputStream
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import AdaptableSession


def add_class_means(model: Path) -> np.ndarray:
    """Recalibrate ``model`` in place as its recipe did; returns the class means [K, D].
    RuntimeError, the file untouched, when a statistic it holds is not reproduced exactly."""
    log = json.loads(model.with_name(model.stem + ".train.json").read_text())
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    clean = images[train_idx]
    clean = clean[np.random.default_rng(log["seed"]).choice(len(clean), CALIBRATION_IMAGES,
                                                             replace=False)]
    metadata = read_metadata(model)
    session = AdaptableSession(model, metadata, "cpu")
    stream = InputStream([str(i) for i in range(len(clean))], None, clean, None,
                         metadata.preprocessing)
    stats = source_statistics(session, stream, 250, progress=False)
    for name in ("source_mean", "source_std", "head_input_mean"):
        if not np.array_equal(stats[name], metadata.arrays[name]):
            raise RuntimeError(f"{model}: {name} is not reproduced; not written")
    write_source_stats(model, model, stats["source_mean"], stats["source_std"],
                       stats["head_input_mean"], stats["head_input_class_means"])
    return stats["head_input_class_means"].reshape(metadata.num_classes, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    args = parser.parse_args()
    means = add_class_means(args.model)
    print(f"{args.model}: head_input_class_means {list(means.shape)} written")


if __name__ == "__main__":
    main()
