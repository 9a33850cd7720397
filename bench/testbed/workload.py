"""What the benchmarks run on: random normalised images and random-weight timm exports (cached)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eva0_edge.runtime.calibrate import calibrate_with_images
from eva0_edge.runtime.modelfile import read_metadata


def random_batch(metadata, batch: int, seed: int = 0) -> np.ndarray:
    """Pixels of random [0, 1] images normalised as the model expects: [B, C, H, W]."""
    pre = metadata.preprocessing
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (batch, *pre.input_size)).astype(np.float32)
    mean = np.asarray(pre.mean, np.float32)[:, None, None]
    std = np.asarray(pre.std, np.float32)[:, None, None]
    return (x - mean) / std


def export_random(
    arch: str, out_dir: Path, seed: int = 0, prompts: int = 0, adapt: str | None = None
) -> Path:
    """Export timm ``arch`` with random weights (seeded) into ``out_dir`` once; reuse after.
    ``adapt``: the adapted layers (``export --adapt``; default the exporter's).

    ``prompts`` > 0: the black-box prompt variant of the same weights. Either file gets source
    statistics from 64 random images (the numbers only need the real code path, not meaning),
    so the activation shift and the alignment term run as on a calibrated model; a cached
    file without them is exported again."""
    layers = f"-a{adapt.replace(',', '_').replace('*', 'x')}" if adapt else ""
    path = out_dir / f"{arch}-seed{seed}{f'-p{prompts}' if prompts else ''}{layers}.onnx"
    if not (path.is_file() and read_metadata(path).has_source_stats):
        import torch

        from eva0_edge.exporter import export_model

        out_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.stem + f".{os.getpid()}.partial.onnx")
        torch.manual_seed(seed)
        metadata = export_model(arch, partial, prompts=prompts, adapt=adapt)
        size = metadata.preprocessing.input_size
        images = np.random.default_rng(seed).integers(
            0, 256, (64, size[1], size[2], size[0]), dtype=np.uint8
        )
        calibrate_with_images(partial, images)
        os.replace(partial, path)
    return path
