"""Source statistics from clean images (features, classifier input), written into the model file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from .data import InputStream
from .head import HeadError, LinearHead, read_head
from .modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from .preprocess import pixels_uint8
from .progress import progress_bar
from .session import AdaptableSession
from .sourcefree import drop_source_free_eva0

log = logging.getLogger(__name__)


def source_statistics(
    session: AdaptableSession, stream: InputStream, batch_size: int = 64, progress: bool = True,
    skip_bad: bool = False,
) -> dict[str, np.ndarray]:
    """The source statistics of the file's arrays over the whole stream under theta0 (with
    ``skip_bad``, an undecodable image file is left out and named in ``stream.skipped``):
    ``source_mean`` / ``source_std`` [F] of the alignment features and, when the classifier
    head can be read from the graph (:mod:`.head`), ``head_input_mean`` [D], the mean input of
    the classifier (what activation shifting moves toward), and ``head_input_class_means``
    [K, D], its mean over the images of each class the file predicts at theta0 (the images are
    unlabelled; a class none is predicted as takes the overall mean): what the shift's
    label-shift correction compares a stream's class mix with (:mod:`.shift`)."""
    metadata = session.metadata
    try:
        head: LinearHead | None = read_head(load_onnx(session.path), metadata)
    except HeadError as err:
        log.info("no head_input_mean: %s", err)
        head = None
    theta0 = metadata.theta0
    total = np.zeros(metadata.num_features, dtype=np.float64)
    total_sq = np.zeros_like(total)
    head_total = np.zeros(head.width if head else 0, dtype=np.float64)
    classes = metadata.num_classes if head is not None else 0
    class_totals = np.zeros((classes, head.width if head else 0), dtype=np.float64)
    class_counts = np.zeros(classes, dtype=np.int64)
    count = 0
    for _, x, _ in progress_bar(
        stream.batches(batch_size, skip_bad=skip_bad), total=-(-len(stream) // batch_size),
        desc="calibrate",
        unit="batch", quiet=not progress,
    ):
        x = session.check_input(x)
        _, features = session.run(x, np.broadcast_to(theta0, (x.shape[0], theta0.size)))
        features = features.astype(np.float64)
        total += features.sum(axis=0)
        total_sq += (features**2).sum(axis=0)
        if head is not None:
            h = head.head_input(features)
            head_total += h.sum(axis=0)
            predicted = (h @ head.weight.T + head.bias).argmax(axis=1)
            np.add.at(class_totals, predicted, h)
            class_counts += np.bincount(predicted, minlength=classes)
        count += x.shape[0]
    if count < 2:
        raise ValueError("calibration needs at least 2 images")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    stats = {"source_mean": mean.astype(np.float32), "source_std": std.astype(np.float32)}
    if head is not None:
        head_mean = head_total / count
        seen = class_counts > 0
        class_means = np.broadcast_to(head_mean, class_totals.shape).copy()
        class_means[seen] = class_totals[seen] / class_counts[seen, None]
        stats["head_input_mean"] = head_mean.astype(np.float32)
        stats["head_input_class_means"] = class_means.astype(np.float32).reshape(-1)
    return stats


def feature_statistics(
    session: AdaptableSession, stream: InputStream, batch_size: int = 64, progress: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std [F] of the alignment features under theta0 over the whole stream."""
    stats = source_statistics(session, stream, batch_size, progress)
    return stats["source_mean"], stats["source_std"]


def write_source_stats(
    model_path: str | os.PathLike,
    output: str | os.PathLike,
    mean: np.ndarray,
    std: np.ndarray,
    head_mean: np.ndarray | None = None,
    head_class_means: np.ndarray | None = None,
) -> Path:
    """Copy ``model_path`` to ``output`` (may be the same file) with source_mean/std (and
    head_input_mean [D] and head_input_class_means [K x D, flat], when given) set; eva0 leaves
    a source-free setup the file may have (:func:`.sourcefree.drop_source_free_eva0`: it aligns
    and shifts to the source again)."""
    model = load_onnx(model_path)
    metadata = drop_source_free_eva0(read_metadata(model))
    metadata.arrays["source_mean"] = np.asarray(mean, dtype=np.float32)
    metadata.arrays["source_std"] = np.asarray(std, dtype=np.float32)
    if head_mean is not None:
        metadata.arrays["head_input_mean"] = np.asarray(head_mean, dtype=np.float32)
    if head_class_means is not None:
        metadata.arrays["head_input_class_means"] = np.asarray(head_class_means,
                                                               dtype=np.float32)
    return save_onnx(set_metadata(model, metadata), output)


def calibrate_with_images(
    model_path: str | os.PathLike,
    images: np.ndarray,
    count: int | None = None,
    seed: int = 0,
    batch_size: int = 250,
    progress: bool = False,
) -> Path:
    """Write source statistics into ``model_path`` from clean uint8 images [N, H, W, C]
    (``count`` of them drawn without replacement with ``seed``, else all)."""
    metadata = read_metadata(model_path)
    if count is not None and count < len(images):
        images = images[np.random.default_rng(seed).choice(len(images), count, replace=False)]
    session = AdaptableSession(model_path, metadata, "cpu")
    stream = InputStream([str(i) for i in range(len(images))], None, images, None,
                         metadata.preprocessing)
    stats = source_statistics(session, stream, batch_size, progress=progress)
    return write_source_stats(model_path, model_path, stats["source_mean"], stats["source_std"],
                              stats.get("head_input_mean"), stats.get("head_input_class_means"))


def sample_pixels(
    stream: InputStream, draws: list[tuple[int, int]], batch_size: int = 64
) -> list[np.ndarray]:
    """For each (count, seed) of ``draws``, uint8 images [n, H, W, C] at the model's input size:
    ``count`` of the stream's decodable images drawn without replacement with ``seed`` (all
    when it has no more), in stream order; one pass over the stream for all draws.
    Undecodable files are skipped (and named in ``stream.skipped``)."""
    good = len(stream) - len(stream.skipped)
    chosen = [set(range(good)) if count >= good else set(
        np.random.default_rng(seed).choice(good, count, replace=False).tolist())
        for count, seed in draws]
    kept: list[list[np.ndarray]] = [[] for _ in draws]
    position = 0
    for _, x, _ in stream.batches(batch_size, skip_bad=True):
        pixels = pixels_uint8(x, stream.pre)
        for rows_of, picked in zip(chosen, kept, strict=True):
            rows = [i for i in range(len(x)) if position + i in rows_of]
            if rows:
                picked.append(pixels[rows])
        position += len(x)
    if not any(kept):
        raise ValueError("no decodable image to fit on")
    return [np.concatenate(picked) for picked in kept]
