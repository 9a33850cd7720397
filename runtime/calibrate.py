"""Source feature statistics from clean images, written into the model file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .data import InputStream
from .modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from .session import AdaptableSession


def feature_statistics(
    session: AdaptableSession, stream: InputStream, batch_size: int = 64, progress: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std [F] of the alignment features under theta0 over the whole stream."""
    theta0 = session.metadata.theta0
    total = np.zeros(session.metadata.num_features, dtype=np.float64)
    total_sq = np.zeros_like(total)
    count = 0
    for _, x, _ in tqdm(
        stream.batches(batch_size),
        total=-(-len(stream) // batch_size),
        desc="calibrate",
        disable=None if progress else True,  # None: off when not a terminal
    ):
        x = session.check_input(x)
        _, features = session.run(x, np.broadcast_to(theta0, (x.shape[0], theta0.size)))
        features = features.astype(np.float64)
        total += features.sum(axis=0)
        total_sq += (features**2).sum(axis=0)
        count += x.shape[0]
    if count < 2:
        raise ValueError("calibration needs at least 2 images")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    return mean.astype(np.float32), std.astype(np.float32)


def write_source_stats(
    model_path: str | os.PathLike,
    output: str | os.PathLike,
    mean: np.ndarray,
    std: np.ndarray,
) -> Path:
    """Copy ``model_path`` to ``output`` (may be the same file) with source_mean/std set."""
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    metadata.arrays["source_mean"] = np.asarray(mean, dtype=np.float32)
    metadata.arrays["source_std"] = np.asarray(std, dtype=np.float32)
    return save_onnx(set_metadata(model, metadata), output)
