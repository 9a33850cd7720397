"""Raw images -> ``pixel_values`` as the model metadata prescribes (timm's eval transform:
resize the shorter side to size / crop_pct, centre-crop, scale to [0, 1], normalise)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from .metadata import Preprocessing

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def _normalise(pixels: np.ndarray, pre: Preprocessing) -> np.ndarray:
    """uint8 [N, H, W, C] -> float32 [N, C, H, W] normalised."""
    x = pixels.astype(np.float32) / 255.0
    mean = np.asarray(pre.mean, dtype=np.float32)
    std = np.asarray(pre.std, dtype=np.float32)
    return np.ascontiguousarray(((x - mean) / std).transpose(0, 3, 1, 2))


def _resize_crop(image: Image.Image, pre: Preprocessing) -> Image.Image:
    """Resize the shorter side to ``size / crop_pct`` and centre-crop ``size``, in one resample
    of the source region that lands in the crop (PIL's ``box``): the same pixels as resizing
    the whole image and cropping, without ever holding the enlarged image (a 250000 x 1 PNG
    would otherwise become 9 M x 36 pixels)."""
    channels, height, width = pre.input_size
    mode = "L" if channels == 1 else "RGB"
    if image.mode != mode:  # an image of the mode already is used as it is, not copied
        image = image.convert(mode)
    if image.size == (width, height):
        return image
    scale = math.floor(max(height, width) / pre.crop_pct)
    w, h = image.size
    if w <= h:
        size = (scale, max(1, round(h * scale / w)))
    else:
        size = (max(1, round(w * scale / h)), scale)
    left = (size[0] - width) // 2
    top = (size[1] - height) // 2
    sx, sy = w / size[0], h / size[1]
    box = (left * sx, top * sy, min(w, (left + width) * sx), min(h, (top + height) * sy))
    resample = _RESAMPLE.get(pre.interpolation, Image.Resampling.BILINEAR)
    return image.resize((width, height), resample, box=box)


def preprocess_images(images: Sequence[Image.Image], pre: Preprocessing) -> np.ndarray:
    """PIL images of any size/mode -> float32 [N, C, H, W]."""
    arrays = []
    for image in images:
        array = np.asarray(_resize_crop(image, pre), dtype=np.uint8)
        arrays.append(array[..., None] if array.ndim == 2 else array)
    return _normalise(np.stack(arrays), pre)


def preprocess_uint8(pixels: np.ndarray, pre: Preprocessing) -> np.ndarray:
    """uint8 images [N, H, W, C] or [N, H, W] -> float32 [N, C, H, W].

    Images of the model's size are only normalised; others go through resize and crop.
    Grey images are repeated to 3 channels when the model expects 3.
    """
    if pixels.dtype != np.uint8 or pixels.ndim not in (3, 4):
        raise ValueError(
            f"raw images must be uint8 [N, H, W] or [N, H, W, C], got {pixels.dtype} "
            f"{list(pixels.shape)}"
        )
    channels, height, width = pre.input_size
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if pixels.shape[-1] not in (1, 3):
        raise ValueError(f"raw images must have 1 or 3 channels, got {pixels.shape[-1]}")
    if pixels.shape[1:3] == (height, width):
        if pixels.shape[-1] == 1 and channels == 3:
            pixels = np.repeat(pixels, 3, axis=-1)
        if pixels.shape[-1] == channels:
            return _normalise(pixels, pre)
    mode = "L" if pixels.shape[-1] == 1 else "RGB"
    images = [Image.fromarray(p[..., 0] if mode == "L" else p, mode) for p in pixels]
    return preprocess_images(images, pre)


def pixels_uint8(pixel_values: np.ndarray, pre: Preprocessing) -> np.ndarray:
    """The inverse of the normalisation: float32 ``pixel_values`` [N, C, H, W] -> the uint8
    images [N, H, W, C] at the model's input size they were made from (exact for pixels made
    by :func:`preprocess_uint8` / :func:`preprocess_images`; others are clipped to 0..255)."""
    mean = np.asarray(pre.mean, dtype=np.float64)[:, None, None]
    std = np.asarray(pre.std, dtype=np.float64)[:, None, None]
    pixels = (pixel_values.astype(np.float64) * std + mean) * 255.0
    images = np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(images.transpose(0, 2, 3, 1))
