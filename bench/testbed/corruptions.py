"""The 15 ImageNet-C corruptions at the 32-pixel (CIFAR-10-C) parameters, seeded per image.

Primitives come from ``imagecorruptions-imaug`` (the maintained fork of ``imagecorruptions``):
disk kernels, the plasma fractal, clipped zoom, the motion-blur kernel, the glass-blur pixel
shuffle and the frost pictures. Its corruption functions hard-code ImageNet-C's 224-pixel
parameters (they erase 32-pixel images), so the functions here re-state each corruption with the
table of ``shared/data/cifar10c-params.md`` (CIFAR-10-C's ``make_cifar_c.py``). Every image gets
its own generator seeded from (seed, corruption, severity, index), so a cached set is the same
whatever order or chunking produced it.

Each function maps a uint8 RGB image [32, 32, 3] to float values in [0, 255].
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from functools import lru_cache
from io import BytesIO

import cv2
import numpy as np
import skimage as sk
from imagecorruptions import corruptions as ic
from PIL import Image
from scipy.ndimage import map_coordinates
from skimage.filters import gaussian

CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog",
    "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
IMAGE_SIZE = 32

PARAMS: dict[str, list] = {
    "gaussian_noise": [0.04, 0.06, 0.08, 0.09, 0.10],
    "shot_noise": [500, 250, 100, 75, 50],
    "impulse_noise": [0.01, 0.02, 0.03, 0.05, 0.07],
    "defocus_blur": [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],
    "glass_blur": [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)],
    "motion_blur": [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],
    "zoom_blur": [1.06, 1.11, 1.16, 1.21, 1.26],
    "snow": [
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ],
    "frost": [(1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)],
    "fog": [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],
    "brightness": [0.05, 0.1, 0.15, 0.2, 0.3],
    "contrast": [0.75, 0.5, 0.4, 0.3, 0.15],
    "elastic_transform": [(0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06),
                          (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)],
    "pixelate": [0.95, 0.9, 0.85, 0.75, 0.65],
    "jpeg_compression": [80, 65, 58, 50, 40],
}


def _unit(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32) / 255.0


def gaussian_noise(x, c, rng):
    return np.clip(_unit(x) + rng.normal(size=x.shape, scale=c), 0, 1) * 255


def shot_noise(x, c, rng):
    return np.clip(rng.poisson(_unit(x) * c) / float(c), 0, 1) * 255


def impulse_noise(x, c, rng):
    noisy = sk.util.random_noise(_unit(x), mode="s&p", rng=int(rng.integers(2**31)), amount=c)
    return np.clip(noisy, 0, 1) * 255


def defocus_blur(x, c, rng):
    kernel = ic.disk(radius=c[0], alias_blur=c[1])
    x = _unit(x)
    channels = [cv2.filter2D(x[:, :, d], -1, kernel) for d in range(3)]
    return np.clip(np.stack(channels, axis=-1), 0, 1) * 255


def glass_blur(x, c, rng):
    blurred = np.uint8(gaussian(_unit(x), sigma=c[0], channel_axis=-1) * 255)
    seed = int(rng.integers(2**31))
    shuffled = ic._shuffle_pixels_njit_glass_blur(IMAGE_SIZE, IMAGE_SIZE, blurred, c, seed)
    return np.clip(gaussian(shuffled / 255.0, sigma=c[0], channel_axis=-1), 0, 1) * 255


def motion_blur(x, c, rng):
    blurred = ic._motion_blur(np.asarray(x), radius=c[0], sigma=c[1],
                              angle=rng.uniform(-45, 45))
    return np.clip(blurred, 0, 255)


def zoom_blur(x, c, rng):
    x = _unit(x)
    out = np.zeros_like(x)
    factors = np.arange(1, c, 0.01)
    for zoom in factors:
        out += ic.clipped_zoom(x, zoom)[:IMAGE_SIZE, :IMAGE_SIZE, :]
    return np.clip((x + out) / (len(factors) + 1), 0, 1) * 255


def snow(x, c, rng):
    x = _unit(x)
    layer = rng.normal(size=x.shape[:2], loc=c[0], scale=c[1])
    layer = ic.clipped_zoom(layer[..., np.newaxis], c[2])
    layer[layer < c[3]] = 0
    layer = np.clip(layer.squeeze(), 0, 1)
    layer = ic._motion_blur(layer, radius=c[4], sigma=c[5], angle=rng.uniform(-135, -45))
    layer = (np.round(layer * 255).astype(np.uint8) / 255.0)[:IMAGE_SIZE, :IMAGE_SIZE, None]
    grey = cv2.cvtColor(x, cv2.COLOR_RGB2GRAY).reshape(IMAGE_SIZE, IMAGE_SIZE, 1)
    x = c[6] * x + (1 - c[6]) * np.maximum(x, grey * 1.5 + 0.5)
    return np.clip(x + layer + np.rot90(layer, k=2), 0, 1) * 255


@lru_cache(maxsize=1)
def frost_pictures() -> tuple[np.ndarray, ...]:
    """The six frost pictures of imagecorruptions, scaled by 0.2 (RGB), loaded once."""
    names = ["frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"]
    pictures = []
    for name in names:
        ref = importlib.resources.files("imagecorruptions") / "frost" / name
        with importlib.resources.as_file(ref) as path:
            picture = cv2.imread(str(path))
        picture = cv2.resize(picture, (0, 0), fx=0.2, fy=0.2)
        pictures.append(picture[..., ::-1].astype(np.float32))
    return tuple(pictures)


def frost(x, c, rng):
    picture = frost_pictures()[int(rng.integers(6))]
    top = int(rng.integers(0, picture.shape[0] - IMAGE_SIZE))
    left = int(rng.integers(0, picture.shape[1] - IMAGE_SIZE))
    crop = picture[top : top + IMAGE_SIZE, left : left + IMAGE_SIZE]
    return np.clip(c[0] * np.asarray(x, dtype=np.float32) + c[1] * crop, 0, 255)


def fog(x, c, rng):
    x = _unit(x)
    max_val = x.max()
    np.random.seed(int(rng.integers(2**31)))  # noqa: NPY002 (plasma_fractal uses the global stream)
    fractal = ic.plasma_fractal(mapsize=IMAGE_SIZE, wibbledecay=c[1])[:IMAGE_SIZE, :IMAGE_SIZE]
    x = x + c[0] * fractal[..., np.newaxis]
    return np.clip(x * max_val / (max_val + c[0]), 0, 1) * 255


def brightness(x, c, rng):
    hsv = sk.color.rgb2hsv(_unit(x))
    hsv[:, :, 2] = np.clip(hsv[:, :, 2] + c, 0, 1)
    return np.clip(sk.color.hsv2rgb(hsv), 0, 1) * 255


def contrast(x, c, rng):
    x = _unit(x)
    means = np.mean(x, axis=(0, 1), keepdims=True)
    return np.clip((x - means) * c + means, 0, 1) * 255


def elastic_transform(x, c, rng):
    image = _unit(x)
    alpha, sigma, affine = (v * IMAGE_SIZE for v in c)
    shape = image.shape
    center = np.float32(shape[:2]) // 2
    square = min(shape[:2]) // 3
    pts1 = np.float32([center + square, [center[0] + square, center[1] - square],
                       center - square])
    pts2 = pts1 + rng.uniform(-affine, affine, size=pts1.shape).astype(np.float32)
    matrix = cv2.getAffineTransform(pts1, pts2)
    image = cv2.warpAffine(image, matrix, shape[1::-1], borderMode=cv2.BORDER_REFLECT_101)
    dx = (gaussian(rng.uniform(-1, 1, size=shape[:2]), sigma, mode="reflect", truncate=3)
          * alpha).astype(np.float32)[..., None]
    dy = (gaussian(rng.uniform(-1, 1, size=shape[:2]), sigma, mode="reflect", truncate=3)
          * alpha).astype(np.float32)[..., None]
    gx, gy, gz = np.meshgrid(np.arange(shape[1]), np.arange(shape[0]), np.arange(shape[2]))
    indices = (gy + dy).reshape(-1, 1), (gx + dx).reshape(-1, 1), gz.reshape(-1, 1)
    warped = map_coordinates(image, indices, order=1, mode="reflect").reshape(shape)
    return np.clip(warped, 0, 1) * 255


def pixelate(x, c, rng):
    image = Image.fromarray(np.asarray(x, dtype=np.uint8))
    small = int(IMAGE_SIZE * c)
    image = image.resize((small, small), Image.Resampling.BOX)
    return np.asarray(image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX))


def jpeg_compression(x, c, rng):
    buf = BytesIO()
    Image.fromarray(np.asarray(x, dtype=np.uint8)).save(buf, "JPEG", quality=c)
    return np.asarray(Image.open(buf))


_FUNCTIONS: dict[str, Callable] = {name: globals()[name] for name in CORRUPTIONS}


def corrupt_image(image: np.ndarray, name: str, severity: int, rng: np.random.Generator):
    """One uint8 RGB image [32, 32, 3] -> its corrupted uint8 version."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown corruption {name!r}; known: {', '.join(CORRUPTIONS)}")
    if severity not in (1, 2, 3, 4, 5):
        raise ValueError(f"severity must be 1..5, got {severity}")
    if image.shape != (IMAGE_SIZE, IMAGE_SIZE, 3) or image.dtype != np.uint8:
        raise ValueError(f"expected uint8 [32, 32, 3], got {image.dtype} {list(image.shape)}")
    out = _FUNCTIONS[name](image, PARAMS[name][severity - 1], rng)
    return np.uint8(np.clip(np.rint(np.asarray(out, dtype=np.float64)), 0, 255))


def corrupt_images(
    images: np.ndarray,
    name: str,
    severity: int,
    seed: int,
    start_index: int = 0,
    indices: np.ndarray | None = None,
) -> np.ndarray:
    """Corrupt uint8 [N, 32, 32, 3] images. Image i uses the generator of (seed, corruption
    index, severity, k) with k = indices[i] if given, else start_index + i: the position in the
    full split, so any subset or chunk reproduces the same pixels."""
    corruption_id = CORRUPTIONS.index(name) if name in CORRUPTIONS else -1
    keys = indices if indices is not None else np.arange(start_index, start_index + len(images))
    if len(keys) != len(images):
        raise ValueError(f"{len(keys)} indices for {len(images)} images")
    out = np.empty_like(images)
    for i, image in enumerate(images):
        rng = np.random.default_rng([seed, corruption_id, severity, int(keys[i])])
        out[i] = corrupt_image(image, name, severity, rng)
    return out


def corrupt_any(images: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """Corrupt uint8 images [N, H, W, C] of any size (C 1 or 3), image i seeded by
    (seed, corruption, severity, i): 32 x 32 RGB images by :func:`corrupt_images` (the
    CIFAR-10-C parameters), others by ``imagecorruptions``' own functions at ImageNet-C's
    parameters (made for 224-pixel images); grey images are corrupted as RGB and averaged
    back to one channel."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"expected uint8 [N, H, W, 1 or 3], got {images.dtype} "
                         f"{list(images.shape)}")
    if name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; known: {', '.join(CORRUPTIONS)}")
    grey = images.shape[-1] == 1
    rgb = np.repeat(images, 3, axis=-1) if grey else images
    if rgb.shape[1:3] == (IMAGE_SIZE, IMAGE_SIZE):
        out = corrupt_images(rgb, name, severity, seed)
    else:
        from imagecorruptions import corrupt

        out = np.empty_like(rgb)
        state = np.random.get_state()  # noqa: NPY002 (the library draws from the global one)
        try:
            for i, image in enumerate(rgb):
                np.random.seed([seed, CORRUPTIONS.index(name), severity, i])  # noqa: NPY002
                corrupted = corrupt(image, corruption_name=name, severity=severity)
                out[i] = np.uint8(np.clip(np.rint(np.asarray(corrupted, np.float64)), 0, 255))
        finally:
            np.random.set_state(state)  # noqa: NPY002
    if grey:
        return np.uint8(np.rint(out.astype(np.float64).mean(axis=-1, keepdims=True)))
    return out
