"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (MIT), as 32x32 RGB uint8.

The 28x28 grey images are zero-padded by 2 pixels on each side and repeated to 3 channels, so
the 32-pixel corruption parameters of CIFAR-10-C apply.
"""

from __future__ import annotations

import gzip
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = [
    "t-shirt/top", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
]
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def dataset_root() -> Path:
    """``$EVA0_FMNIST_ROOT`` or Debian's install folder."""
    return Path(os.environ.get("EVA0_FMNIST_ROOT", DEFAULT_ROOT))


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08:  # unsigned byte payload
        raise ValueError(f"{path}: not an IDX uint8 file (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(shape)):
        raise ValueError(f"{path}: truncated ({payload.size} bytes for shape {shape})")
    return payload.reshape(shape)


def load_fashion_mnist(split: str, root: str | os.PathLike | None = None):
    """Images uint8 [N, 32, 32, 3] and labels int64 [N] of ``split`` ('train' or 'test').

    Decoded once per (split, root) and shared: the arrays are read-only.
    """
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return _load(split, Path(root) if root else dataset_root())


@lru_cache(maxsize=4)
def _load(split: str, root: Path) -> tuple[np.ndarray, np.ndarray]:
    image_file, label_file = (root / name for name in _FILES[split])
    if not image_file.is_file():
        raise FileNotFoundError(
            f"Fashion-MNIST not found at {root}: apt-get install -y dataset-fashion-mnist "
            "(or set EVA0_FMNIST_ROOT)"
        )
    images = _read_idx(image_file)
    labels = _read_idx(label_file).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"{root}: {len(images)} images but {len(labels)} labels")
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    rgb = np.repeat(padded[..., None], 3, axis=-1)
    rgb.flags.writeable = False
    labels.flags.writeable = False
    return rgb, labels


VAL_SIZE = 5000
SPLIT_SEED = 0
CALIBRATION_IMAGES = 5000  # clean training images behind a shipped model's source statistics


def train_val_indices(n_train: int = 60000, val_size: int = VAL_SIZE, seed: int = SPLIT_SEED):
    """Indices of the training part and of the held-out validation part of the train split.

    The validation images are never trained on; tuning corrupts them with its own seed, so no
    test image is ever used to choose a hyper-parameter.
    """
    order = np.random.default_rng(seed).permutation(n_train)
    return np.sort(order[val_size:]), np.sort(order[:val_size])


def clean_training_images() -> np.ndarray:
    """The clean images the source models train on (train split minus validation), uint8
    [N, 32, 32, 3]."""
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    return images[train_idx]
