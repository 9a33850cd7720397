"""Corrupted evaluation domains: Fashion-MNIST-C (generated once into the cache) or a user's
ImageNet-C-style folder tree ``ROOT/corruption/severity/class/image``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eva0_edge.runtime.atomic import atomic_write
from eva0_edge.runtime.cache import cache_dir
from eva0_edge.runtime.data import IMAGE_SUFFIXES, InputStream
from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.progress import progress_bar

from .corruptions import CORRUPTIONS, corrupt_images
from .fashion_mnist import load_fashion_mnist, train_val_indices
from .hostile import HOSTILE, LEVELLED, ORDERED, hostile_images, is_hostile

TEST_SEED = 2026  # corruption seed of the test domains
CLEAN = "clean"  # the domain of uncorrupted images ("does adapting hurt clean data?")
VALIDATION_SEED = 7  # corruption seed of the tuning domains (held-out train images)
_CHUNK = 500


@dataclass
class Domain:
    """One corruption at one severity: images (uint8 [N, 32, 32, 3] or files) and labels [N]
    (-1: unlabelled). ``ordered``: the order is the stream (never shuffled)."""

    name: str
    severity: int
    labels: np.ndarray
    images: np.ndarray | None = None
    files: list[Path] | None = None
    ordered: bool = False

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, order: np.ndarray) -> Domain:
        """The domain re-ordered / restricted to ``order`` (indices)."""
        return Domain(
            self.name,
            self.severity,
            self.labels[order],
            self.images[order] if self.images is not None else None,
            [self.files[i] for i in order] if self.files is not None else None,
            self.ordered,
        )

    def stream(self, pre: Preprocessing) -> InputStream:
        names = [f"{self.name}/{i}" for i in range(len(self))]
        return InputStream(names, self.labels, self.images, self.files, pre)

    def batches(
        self, batch_size: int, pre: Preprocessing
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for _, x, y in self.stream(pre).batches(batch_size):
            yield x, y


def pooled(domains: Sequence[Domain], name: str) -> Domain:
    """The domains' samples as one domain ``name`` (theirs one after another; ``severity``:
    the first's), as arrays or as files; ValueError when some have arrays and some files."""
    kinds = {d.images is None for d in domains}
    if len(kinds) != 1:
        raise ValueError("cannot pool domains of image arrays with domains of image files")
    files = None if domains[0].images is not None else [f for d in domains for f in d.files]
    images = None if files is not None else np.concatenate([d.images for d in domains])
    labels = np.concatenate([d.labels for d in domains])
    return Domain(name, domains[0].severity, labels, images, files)

def corrupted_fmnist(
    split: str,
    corruption: str,
    severity: int,
    seed: int,
    indices: np.ndarray | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, 32, 32, 3] corrupted images and labels of a Fashion-MNIST split
    (``corruption`` :data:`CLEAN`: the images as they are).

    The whole split is generated once into ``cache_dir()/fmnist-c`` (an atomic ``.npy``) and
    loaded afterwards. With ``indices`` and no cache yet, only those images are generated (not
    cached): the same pixels as in the full set, since each image is seeded by its index.
    ``split``: 'test', or 'val' (the 5000 held-out train images).
    """
    if corruption not in (CLEAN, *CORRUPTIONS) and not is_hostile(corruption):
        raise ValueError(
            f"unknown domain {corruption!r}; known: {CLEAN}, {', '.join(CORRUPTIONS)}, and the "
            f"hostile streams {', '.join(HOSTILE)} and {', '.join(f'{k}-LEVEL' for k in LEVELLED)}"
        )
    base_split = "train" if split == "val" else split
    images, labels = load_fashion_mnist(base_split)
    if split == "val":
        _, val_idx = train_val_indices(len(images))
        images, labels = images[val_idx], labels[val_idx]
    if corruption == CLEAN or is_hostile(corruption):
        if indices is not None:
            images, labels = images[indices], labels[indices]
        if is_hostile(corruption):
            return hostile_images(corruption, images, labels, seed)
        return images, labels
    path = cache_dir() / "fmnist-c" / f"{split}-seed{seed}" / f"{corruption}-{severity}.npy"
    if path.is_file():
        cached = np.load(path, mmap_mode="r", allow_pickle=False)
        if cached.shape == images.shape:
            if indices is None:
                return np.asarray(cached), labels
            return np.asarray(cached[indices]), labels[indices]
    if indices is not None:
        return corrupt_images(images[indices], corruption, severity, seed,
                              indices=indices), labels[indices]
    out = np.empty_like(images)
    for start in progress_bar(
        range(0, len(images), _CHUNK), desc=f"generating {split} {corruption}-{severity}",
        unit="chunk", quiet=not progress, leave=False,
    ):
        stop = min(start + _CHUNK, len(images))
        out[start:stop] = corrupt_images(images[start:stop], corruption, severity, seed, start)
    atomic_write(path, lambda f: np.save(f, out, allow_pickle=False))
    return out, labels


def fmnist_c_domains(
    severity: int,
    split: str = "test",
    seed: int | None = None,
    corruptions: Sequence[str] = CORRUPTIONS,
    indices: np.ndarray | None = None,
    progress: bool = True,
) -> list[Domain]:
    """The corrupted domains of Fashion-MNIST-C at one severity (test or validation split),
    restricted to ``indices`` of the split when given; :data:`CLEAN` names the uncorrupted
    images as a domain, and :data:`hostile.HOSTILE` the hostile streams."""
    if seed is None:
        seed = TEST_SEED if split == "test" else VALIDATION_SEED
    domains = []
    for name in corruptions:
        images, labels = corrupted_fmnist(split, name, severity, seed, indices, progress)
        domains.append(Domain(name, severity, labels, images=images, ordered=name in ORDERED))
    return domains


def folder_domains(
    root: str | os.PathLike, severity: int, corruptions: Sequence[str] | None = None
) -> list[Domain]:
    """ImageNet-C-style tree: ``root/<corruption>/<severity>/<class>/<image>``. Class indices are
    the sorted class-folder names (the ImageNet convention)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder not found: {root}")
    names = corruptions or sorted(
        p.name for p in root.iterdir() if (p / str(severity)).is_dir()
    )
    absent = sorted(set(names) - {p.name for p in root.iterdir() if p.is_dir()})
    if absent:
        raise ValueError(
            f"no folder for {absent} under {root} (a clean domain is a folder "
            f"{CLEAN}/{severity}/class/image here)"
        )
    if not names:
        raise ValueError(f"no <corruption>/{severity}/ folders under {root}")
    ordered = [c for c in CORRUPTIONS if c in names] + [c for c in names if c not in CORRUPTIONS]
    domains = []
    for name in ordered:
        level = root / name / str(severity)
        classes = sorted(p.name for p in level.iterdir() if p.is_dir())
        files, labels = [], []
        for index, cls in enumerate(classes):
            found = sorted(
                p for p in (level / cls).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES
            )
            files += found
            labels += [index] * len(found)
        if not files:
            raise ValueError(f"no images under {level}")
        domains.append(Domain(name, severity, np.asarray(labels, dtype=np.int64), files=files))
    return domains
