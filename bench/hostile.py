"""Hostile streams: what an adapter left running meets and was never tuned for. Each is built
from a subset of clean images (uint8 [N, 32, 32, 3], labels [N]) and keeps N images:

* ``black`` / ``white``: one constant frame (a camera facing a wall, no signal); unlabelled;
* ``repeat``: one real image over and over (a stuck frame), with its label;
* ``noise``: uniform noise, unlabelled;
* ``burst``: the clean images in single-class runs (a production line switching products);
* ``alternate``: runs of 50 clean and 50 fog (severity 5) images in turn.

Unlabelled images carry label -1: they count in the stream but not in the accuracy. The
streams that are an order (``burst``, ``alternate``) are marked ``ordered`` and never shuffled.
"""

from __future__ import annotations

import numpy as np

from .corruptions import corrupt_images

HOSTILE = ("black", "white", "repeat", "noise", "burst", "alternate")
ORDERED = ("repeat", "burst", "alternate")
UNLABELLED = -1
ALTERNATE_RUN = 50


def hostile_images(
    name: str, images: np.ndarray, labels: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The hostile stream ``name`` built from clean ``images`` [N, H, W, 3] uint8 and
    ``labels`` [N]: (images [N, H, W, 3] uint8, labels [N] int64, -1 = unlabelled)."""
    count = len(labels)
    unlabelled = np.full(count, UNLABELLED, dtype=np.int64)
    if name in ("black", "white"):
        return np.full_like(images, 0 if name == "black" else 255), unlabelled
    if name == "repeat":
        return np.repeat(images[:1], count, axis=0), np.repeat(labels[:1], count)
    if name == "noise":
        rng = np.random.default_rng([seed, 404])
        return rng.integers(0, 256, images.shape, dtype=np.uint8), unlabelled
    if name == "burst":
        order = np.argsort(labels, kind="stable")
        return images[order], labels[order]
    if name == "alternate":
        out = images.copy()
        fogged = (np.arange(count) // ALTERNATE_RUN) % 2 == 1
        if fogged.any():
            out[fogged] = corrupt_images(images[fogged], "fog", 5, seed,
                                         indices=np.flatnonzero(fogged))
        return out, labels.copy()
    raise ValueError(f"unknown hostile stream {name!r}; known: {', '.join(HOSTILE)}")
