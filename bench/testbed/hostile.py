"""Hostile streams: what an adapter left running meets and was never tuned for. Each is built
from a subset of clean images (uint8 [N, 32, 32, 3], labels [N]) and keeps N images:

* ``black`` / ``white``: one constant frame (a camera facing a wall, no signal); unlabelled;
* ``repeat``: one real image over and over (a stuck frame), with its label;
* ``noise``: uniform noise, unlabelled;
* ``burst``: the clean images in single-class runs (a production line switching products);
* ``alternate``: runs of 50 clean and 50 fog (severity 5) images in turn;
* levelled sensor faults, labelled, one level each (the hostile protocol's sweep,
  :data:`NOISE_SWEEP`): ``gauss-S`` additive Gaussian noise of standard deviation S on [0, 1]
  pixels (a cheap sensor in low light; Fashion-MNIST-C's severities are S = .04-.10),
  ``blur-R`` a Gaussian blur of radius R pixels (defocus), ``jpeg-Q`` JPEG at quality Q (a
  starved uplink).

Unlabelled images carry label -1: they count in the stream but not in the accuracy. The
streams that are an order (``burst``, ``alternate``) are marked ``ordered`` and never shuffled.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageFilter

from .corruptions import corrupt_images

HOSTILE = ("black", "white", "repeat", "noise", "burst", "alternate")
ORDERED = ("repeat", "burst", "alternate")
UNLABELLED = -1
ALTERNATE_RUN = 50
LEVELLED = ("gauss", "blur", "jpeg")
# Each followed by clean images in the sweep: is the return to clean safe at every level?
NOISE_SWEEP = ("gauss-0.1", "gauss-0.2", "gauss-0.3", "gauss-0.5", "blur-1", "blur-2",
               "jpeg-20", "jpeg-5")


def levelled(name: str) -> tuple[str, float] | None:
    """``"gauss-0.3"`` -> ``("gauss", 0.3)``; None for any other name; ValueError for a
    levelled name whose level is not a positive number (a JPEG quality: 1..95)."""
    kind, sep, level = name.partition("-")
    if not sep or kind not in LEVELLED:
        return None
    try:
        value = float(level)
    except ValueError:
        raise ValueError(f"hostile stream {name!r}: the level after '-' is a number") from None
    if not value > 0 or (kind == "jpeg" and not (value == int(value) and value <= 95)):
        raise ValueError(f"hostile stream {name!r}: level {level} is out of range")
    return kind, value


def is_hostile(name: str) -> bool:
    """Whether ``name`` is a hostile stream (a levelled one included)."""
    return name in HOSTILE or levelled(name) is not None


def _sensor_fault(kind: str, level: float, images: np.ndarray, seed: int) -> np.ndarray:
    """``images`` [N, H, W, 3] uint8 through one levelled fault (see the module docstring)."""
    if kind == "gauss":
        rng = np.random.default_rng([seed, 405, int(round(level * 1000))])
        noisy = images.astype(np.float64) + rng.normal(0.0, level * 255.0, images.shape)
        return np.uint8(np.clip(np.rint(noisy), 0, 255))
    out = np.empty_like(images)
    for i, image in enumerate(images):
        picture = Image.fromarray(image)
        if kind == "blur":
            out[i] = np.asarray(picture.filter(ImageFilter.GaussianBlur(level)))
        else:
            buffer = io.BytesIO()
            picture.save(buffer, format="JPEG", quality=int(level))
            out[i] = np.asarray(Image.open(buffer).convert("RGB"))
    return out


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
    fault = levelled(name)
    if fault is not None:
        return _sensor_fault(*fault, images, seed), labels.copy()
    if name == "alternate":
        out = images.copy()
        fogged = (np.arange(count) // ALTERNATE_RUN) % 2 == 1
        if fogged.any():
            out[fogged] = corrupt_images(images[fogged], "fog", 5, seed,
                                         indices=np.flatnonzero(fogged))
        return out, labels.copy()
    raise ValueError(f"unknown hostile stream {name!r}; known: {', '.join(HOSTILE)} and "
                     f"{', '.join(f'{k}-LEVEL' for k in LEVELLED)}")
