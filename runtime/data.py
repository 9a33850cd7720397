"""Input streams for the CLI: ``.npy`` / ``.npz`` arrays or an image folder, read lazily in
batches. An image folder is read in sorted relative-path order: that order is the stream."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .metadata import Preprocessing
from .preprocess import preprocess_images, preprocess_uint8

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}
_ARRAY_KEYS = ("x", "images", "pixel_values", "data")
_LABEL_KEYS = ("y", "labels", "targets")


@dataclass
class InputStream:
    """A sequence of samples with names (and labels when the source has them).

    ``batches(n)`` yields (names, pixel_values [B, C, H, W] float32, labels [B] or None).
    With ``skip_bad``, an image file that cannot be decoded is left out of its batch (a batch
    may then be smaller, and one with nothing left is not yielded) and its name and reason
    are added to ``skipped`` (once, however many passes over the stream meet it);
    without, the images of its batch before it are yielded first (a smaller batch, when there
    are any), then it raises ValueError naming the file. :meth:`skipped_summary` is how
    ``adapt``, ``calibrate`` and ``quantize`` report the skipped files.
    """

    names: list[str]
    labels: np.ndarray | None
    _array: np.ndarray | None
    _files: list[Path] | None
    pre: Preprocessing
    skipped: list[tuple[str, str]] = field(default_factory=list)
    _skipped_names: set[str] = field(default_factory=set, repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def skipped_summary(self) -> str:
        """``", 2 undecodable input(s) skipped (a.png, b.png)"`` (the first five named, then
        ``and N more``) to end a command's summary line; ``""`` when none was skipped."""
        if not self.skipped:
            return ""
        names = ", ".join(name for name, _ in self.skipped[:5])
        more = f" and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
        return f", {len(self.skipped)} undecodable input(s) skipped ({names}{more})"

    def batches(
        self, batch_size: int, skip_bad: bool = False
    ) -> Iterator[tuple[list[str], np.ndarray, np.ndarray | None]]:
        if batch_size < 1:
            raise ValueError("batch size must be >= 1")
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            labels = self.labels[start:stop] if self.labels is not None else None
            pixels, kept, bad = self._load(start, stop, skip_bad)
            if kept:
                names = [self.names[start + i] for i in kept]
                yield names, pixels, None if labels is None else labels[kept]
            if bad is not None:
                raise bad

    def _load(
        self, start: int, stop: int, skip_bad: bool
    ) -> tuple[np.ndarray, list[int], ValueError | None]:
        """The batch's pixels, the positions in [start, stop) they come from and, without
        ``skip_bad``, the error of the first file that cannot be decoded (the batch then ends
        before it), else None."""
        if self._array is not None:
            chunk = self._array[start:stop]
            kept = list(range(len(chunk)))
            if chunk.dtype == np.uint8:
                return preprocess_uint8(chunk, self.pre), kept, None
            return np.asarray(chunk, dtype=np.float32), kept, None
        images, kept, bad = [], [], None
        for i, path in enumerate((self._files or [])[start:stop]):
            try:
                with Image.open(path) as image:
                    image.load()
                    images.append(image)
                    kept.append(i)
            except (UnidentifiedImageError, OSError) as err:
                if not skip_bad:
                    bad = ValueError(f"cannot decode image {path}: {err}")
                    bad.__cause__ = err
                    break
                name = self.names[start + i]
                if name not in self._skipped_names:
                    self._skipped_names.add(name)
                    self.skipped.append((name, str(err)))
        pixels = preprocess_images(images, self.pre) if images else np.zeros((0,))
        return pixels, kept, bad


def _pick(npz: np.lib.npyio.NpzFile, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in npz.files), None)


def open_input(path: str | os.PathLike, pre: Preprocessing) -> InputStream:
    """Open ``path``: a folder of images, a ``.npy`` array, or a ``.npz`` with an image array
    (key x / images / pixel_values / data, or its only array) and optional labels (y / labels /
    targets). Arrays are float32 [N, C, H, W] normalised pixels, or uint8 images
    [N, H, W(, C)] that are preprocessed here."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {path}")
        names = [p.relative_to(path).as_posix() for p in files]
        return InputStream(names, None, None, files, pre)
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    labels = None
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    elif path.suffix == ".npz":
        npz = np.load(path, allow_pickle=False)
        key = _pick(npz, _ARRAY_KEYS) or (npz.files[0] if len(npz.files) == 1 else None)
        if key is None:
            raise ValueError(f"{path}: no image array (keys tried: {_ARRAY_KEYS})")
        array = npz[key]
        label_key = _pick(npz, _LABEL_KEYS)
        labels = np.asarray(npz[label_key]).astype(np.int64) if label_key else None
    else:
        raise ValueError(f"unsupported input {path}: use a folder, .npy or .npz")
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{path}: images must be uint8 or float, got {array.dtype}")
    if labels is not None and len(labels) != len(array):
        raise ValueError(f"{path}: {len(labels)} labels for {len(array)} images")
    names = [str(i) for i in range(len(array))]
    return InputStream(names, labels, array, None, pre)
