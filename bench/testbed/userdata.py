"""A user's labelled images as tuning data: the clean images and the testbed's corruptions of
them (``eva0-edge tune --data``).

Labels come from class sub-folders (``data/<class>/<image>``, the folder name one of the
model's labels or its index), a CSV (``--labels``: ``image,label`` rows, the image as the
stream names it, the label a class name or index), or a ``.npz``'s label array. Images are
brought to the model's input size (its resize and crop) as uint8 [N, H, W, C]; an image file
that cannot be decoded is skipped and named.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from eva0_edge.runtime.data import InputStream, open_input
from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.preprocess import pixels_uint8
from eva0_edge.runtime.progress import progress_bar

from .corruptions import CORRUPTIONS, corrupt_any
from .datasets import CLEAN, VALIDATION_SEED, Domain
from .tuner import TuneData


def class_index(name: str, labels: list[str]) -> int:
    """The model's class index of ``name``: one of its labels (exact, else ignoring case and
    ``_`` / ``-`` / space), or an index; ValueError naming the model's labels otherwise."""
    if name in labels:
        return labels.index(name)

    def plain(text: str) -> str:
        return "".join(c for c in text.lower() if c.isalnum())

    folded = [plain(label) for label in labels]
    if plain(name) in folded and folded.count(plain(name)) == 1:
        return folded.index(plain(name))
    if name.strip().isdigit() and int(name) < len(labels):
        return int(name)
    shown = ", ".join(labels[:12]) + (", ..." if len(labels) > 12 else "")
    raise ValueError(f"label {name!r} is not one of the model's {len(labels)} classes "
                     f"({shown}) nor an index below {len(labels)}")


def _labels_of(stream: InputStream, root: Path, labels_csv: str | None,
               metadata: ModelMetadata) -> np.ndarray:
    """Labels [N] of the stream's samples, in its order."""
    if labels_csv is not None:
        with open(labels_csv, newline="") as handle:
            rows = [row for row in csv.reader(handle) if row and not row[0].startswith("#")]
        if rows and rows[0][:2] == ["image", "label"]:
            rows = rows[1:]
        given = {}
        for number, row in enumerate(rows, 1):
            if len(row) < 2:
                raise ValueError(f"{labels_csv}:{number}: need 'image,label', got {row}")
            given[row[0].strip()] = class_index(row[1].strip(), metadata.labels)
        missing = [name for name in stream.names if name not in given]
        if missing:
            raise ValueError(f"{labels_csv} has no label for {len(missing)} image(s), e.g. "
                             f"{missing[0]!r} (rows are image,label; images as named under "
                             f"{root})")
        return np.asarray([given[name] for name in stream.names], dtype=np.int64)
    if stream.labels is not None:
        return stream.labels
    if not root.is_dir() or any("/" not in name for name in stream.names):
        raise ValueError(f"{root}: no labels; put the images in class sub-folders "
                         "(data/<class>/<image>) or give --labels labels.csv")
    return np.asarray([class_index(name.split("/", 1)[0], metadata.labels)
                       for name in stream.names], dtype=np.int64)


def labelled_images(
    path: str | os.PathLike, metadata: ModelMetadata, labels_csv: str | None = None,
    batch_size: int = 64, progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The decodable labelled images of ``path`` at the model's input size: uint8
    [N, H, W, C], their labels [N] and the names of the files skipped."""
    stream = open_input(path, metadata.preprocessing)
    labels = _labels_of(stream, Path(path), labels_csv, metadata)
    by_name = dict(zip(stream.names, labels, strict=True))
    images, kept = [], []
    for names, x, _ in progress_bar(stream.batches(batch_size, skip_bad=True),
                                    total=-(-len(stream) // batch_size), desc="read",
                                    unit="batch", quiet=not progress):
        images.append(pixels_uint8(x, metadata.preprocessing))
        kept += [by_name[name] for name in names]
    if not images:
        raise ValueError(f"no decodable image under {path}")
    return np.concatenate(images), np.asarray(kept, dtype=np.int64), \
        [name for name, _ in stream.skipped]


def user_tune_data(
    images: np.ndarray, labels: np.ndarray, limit: int, clean_limit: int, severity: int,
    seed: int = 0, progress: bool = False,
) -> TuneData:
    """Tuning data from labelled uint8 images: ``clean_limit`` of them clean, and ``limit``
    of them under each of the 15 corruptions at ``severity`` (seeded subsets; the corruptions
    seeded with the validation seed)."""
    rng = np.random.default_rng(seed)

    def subset(count: int) -> np.ndarray:
        return np.sort(rng.choice(len(images), min(count, len(images)), replace=False))

    clean = subset(clean_limit)
    chosen = subset(limit)
    corrupted = [
        Domain(name, severity, labels[chosen],
               images=corrupt_any(images[chosen], name, severity, VALIDATION_SEED))
        for name in progress_bar(CORRUPTIONS, total=len(CORRUPTIONS), desc="corrupt",
                                 unit="corruption", quiet=not progress)
    ]
    return TuneData(corrupted, [Domain(CLEAN, 0, labels[clean], images=images[clean])],
                    "user", severity)
