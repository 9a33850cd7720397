"""What the served model takes and gives, in protocol terms.

Inputs (exactly one per request):
* ``pixel_values`` FP32 [B, C, H, W], already preprocessed per the model metadata;
* ``images`` BYTES [B], encoded PNG/JPEG images the server preprocesses (other formats are
  refused), at most ``max_pixels`` decoded pixels per request, read from the image headers
  before anything is decoded (413 beyond).

Outputs: ``logits`` FP32 [B, K], ``probabilities`` FP32 [B, K] (softmax), ``labels`` BYTES [B, k]
(class names by decreasing probability; ``k`` is the output parameter ``top_k``, or
``classification`` as tritonclient's ``class_count`` sends it; default 5).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..metadata import ModelMetadata
from ..preprocess import preprocess_images
from .protocol import InferRequest, ProtocolError, RequestedOutput

PIXELS = "pixel_values"
IMAGES = "images"
OUTPUTS = ("logits", "probabilities", "labels")
DEFAULT_TOP_K = 5


def model_metadata(name: str, version: str, metadata: ModelMetadata) -> dict:
    """The protocol's model metadata response."""
    c, h, w = metadata.preprocessing.input_size
    k = metadata.num_classes
    return {
        "name": name,
        "versions": [version],
        "platform": "onnxruntime_onnx",
        "inputs": [  # what a request sends; ``images`` is the optional other way (config)
            {"name": PIXELS, "datatype": "FP32", "shape": [-1, c, h, w]},
        ],
        "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [-1, k]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, k]},
            {"name": "labels", "datatype": "BYTES", "shape": [-1, -1]},
        ],
    }


FORMATS = ("PNG", "JPEG")


def _image_error(i: int, err: Exception) -> ProtocolError:
    """A decoding error for images[i], without the object reprs PIL puts in its messages."""
    reason = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(err))[:200]
    return ProtocolError(f"images[{i}] is not a decodable PNG/JPEG image ({reason})")


def _decode_images(items: list[bytes], metadata: ModelMetadata, max_pixels: int) -> np.ndarray:
    """Open every image lazily (headers only) and check the pixel budget; then decode and
    reduce one image at a time, so the memory held is one decoded image, not the request's."""
    opened, pixels = [], 0
    for i, data in enumerate(items):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=FORMATS)
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
                Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise _image_error(i, err) from None
        pixels += image.width * image.height
        if pixels > max_pixels:
            raise ProtocolError(
                f"images up to images[{i}] hold {pixels} pixels, over the server's budget of "
                f"{max_pixels} per request (--max-pixels-mp)", 413,
            )
        opened.append(image)
    reduced = []
    for i, picture in enumerate(opened):
        try:
            picture.load()
            reduced.append(preprocess_images([picture], metadata.preprocessing))
        except (OSError, ValueError, SyntaxError) as err:
            raise _image_error(i, err) from None
        finally:
            picture.close()  # frees its pixels: one decoded image held at a time
    return np.concatenate(reduced)


def model_input(
    request: InferRequest, metadata: ModelMetadata, max_batch: int, max_pixels: int
) -> np.ndarray:
    """The request's batch as float32 [B, C, H, W] (not yet range-checked); ``max_pixels``:
    the decoded-pixel budget of an ``images`` request."""
    names = set(request.inputs)
    unknown = names - {PIXELS, IMAGES}
    if unknown:
        raise ProtocolError(
            f"unknown input {sorted(unknown)[0]!r}; this model takes {PIXELS!r} (FP32 "
            f"[B, {', '.join(map(str, metadata.preprocessing.input_size))}]) or {IMAGES!r} "
            "(BYTES [B], encoded PNG/JPEG)"
        )
    if len(names) != 1:
        raise ProtocolError(f"give exactly one of {PIXELS!r} and {IMAGES!r}")
    (name,) = names
    data = request.inputs[name]
    batch = len(data) if isinstance(data, list) else (data.shape[0] if data.ndim else 0)
    if batch > max_batch:
        raise ProtocolError(f"batch of {batch} exceeds the server's max batch {max_batch}")
    if name == IMAGES:
        if request.datatypes[name] != "BYTES" or isinstance(data, np.ndarray):
            raise ProtocolError(f"{IMAGES!r} must be BYTES, got {request.datatypes[name]}")
        if not data:
            raise ProtocolError(f"{IMAGES!r} is an empty batch")
        return _decode_images(data, metadata, max_pixels)
    if request.datatypes[name] != "FP32" or not isinstance(data, np.ndarray):
        raise ProtocolError(f"{PIXELS!r} must be FP32, got {request.datatypes[name]}")
    return data


def _top_labels(probabilities: np.ndarray, labels: list[str], k: int) -> np.ndarray:
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    names = np.array([label.encode() for label in labels], dtype=object)
    return names[order]


@dataclass(frozen=True)
class OutputPlan:
    """A validated output request: name, binary or JSON, and k for ``labels``."""

    name: str
    binary: bool
    top_k: int = 0


def plan_outputs(
    requested: list[RequestedOutput] | None, binary_default: bool, num_classes: int
) -> list[OutputPlan]:
    """Check the requested outputs before anything runs (all three when none are named)."""
    wanted = requested or [RequestedOutput(name, binary_default) for name in OUTPUTS]
    plans = []
    for spec in wanted:
        if spec.name not in OUTPUTS:
            raise ProtocolError(f"unknown output {spec.name!r}; outputs: {list(OUTPUTS)}")
        k = 0
        if spec.name == "labels":
            k = spec.parameters.get("top_k", spec.parameters.get("classification", DEFAULT_TOP_K))
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ProtocolError(f"output 'labels': top_k must be a positive integer, got {k!r}")
        plans.append(OutputPlan(spec.name, spec.binary, min(k, num_classes)))
    return plans


def model_outputs(
    logits: np.ndarray, plans: list[OutputPlan], labels: list[str]
) -> list[tuple[str, np.ndarray, bool]]:
    """``(name, array, binary)`` for each planned output, from logits [B, K]."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    out = []
    for plan in plans:
        if plan.name == "logits":
            array = logits.astype(np.float32)
        elif plan.name == "probabilities":
            array = probabilities.astype(np.float32)
        else:
            array = _top_labels(probabilities, labels, plan.top_k)
        out.append((plan.name, array, plan.binary))
    return out
