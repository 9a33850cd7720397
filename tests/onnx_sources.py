"""Plain ONNX classifiers from several exporters, as a user brings them: the sources of the
``export --onnx`` tests. Random-initialised timm models whose norm affines and BatchNorm
statistics are drawn away from identity (so theta0 is not all ones and zeros, and a folded
BatchNorm changes the convolution), exported by

* ``dynamo18``: ``torch.onnx.export(dynamo=True, opset_version=18)`` (its optimiser folds
  BatchNorm into the convolutions);
* ``script17``: the TorchScript exporter (``dynamo=False``) at opset 17, dynamic batch (it
  writes GroupNorm decomposed: InstanceNormalization, then Mul / Add by the affine);
* ``script16``: the same at opset 16, where LayerNorm is decomposed too (ReduceMean, Sub, Pow,
  Sqrt, Div, then Mul / Add);
* ``script17-batch1``: the same with the batch fixed at 1 (no dynamic axes);
* ``ort-basic`` / ``ort-extended``: ``dynamo18``'s file as ONNX Runtime's optimiser writes it
  (``optimized_model_filepath``): constant-folded, and at ``extended`` with ORT's fused
  contrib ops (FusedConv, SkipLayerNormalization).

Files are written once per test session into the folder the caller gives.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

# timm architecture -> (create_model kwargs, image size): one per family the issue names
ARCHS: dict[str, tuple[dict, int]] = {
    "resnet18": ({}, 64),
    "resnet18-gn": ({"norm_layer": "groupnorm"}, 64),
    "mobilenetv3_small_100": ({}, 64),
    "efficientnet_lite0": ({}, 64),
    "regnetx_002": ({}, 64),
    "convnext_atto": ({}, 64),
    "deit_tiny_patch16_224": ({"img_size": 64}, 64),
    "swin_tiny_patch4_window7_224": (
        {"img_size": 64, "window_size": 4, "embed_dim": 48, "depths": (1, 1, 2, 1),
         "num_heads": (2, 2, 2, 2)}, 64),
}
EXPORTERS = ("dynamo18", "script17", "script16", "script17-batch1", "ort-basic",
             "ort-extended")


def timm_model(arch: str, seed: int = 0):
    """The random-initialised timm model (10 classes), eval mode, affines off identity."""
    import timm
    import torch

    kwargs, _ = ARCHS[arch]
    torch.manual_seed(seed)
    model = timm.create_model(arch.split("-")[0], num_classes=10, **kwargs).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and not name.startswith(("head", "fc", "classifier")):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("running_var"):
                buffer.uniform_(0.5, 2.0, generator=generator)
            elif name.endswith("running_mean"):
                buffer.normal_(0.0, 0.1, generator=generator)
    return model


def source_file(folder: Path, arch: str, exporter: str) -> Path:
    """``folder/<arch>.<exporter>.onnx``, exported on first use."""
    path = folder / f"{arch}.{exporter}.onnx"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    if exporter.startswith("ort-"):
        _ort_optimised(source_file(folder, arch, "dynamo18"), path, exporter[4:])
        return path
    import torch

    model = timm_model(arch)
    size = ARCHS[arch][1]
    x = torch.randn(2 if exporter == "dynamo18" else 1, 3, size, size)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo18":
            program = torch.onnx.export(
                model, (x,), input_names=["input"], output_names=["output"],
                dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), opset_version=18,
                dynamo=True, optimize=True, verbose=False)
            program.save(str(path))
        else:
            axes = {} if exporter.endswith("batch1") else {"input": {0: "batch"}}
            opset = 16 if exporter == "script16" else 17
            torch.onnx.export(model, (x,), str(path), input_names=["input"],
                              output_names=["output"], dynamic_axes=axes, opset_version=opset,
                              dynamo=False)
    return path


def _ort_optimised(source: Path, path: Path, level: str) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


def images(n: int, size: int, seed: int = 0) -> np.ndarray:
    """[n, 3, size, size] float32 inputs, standard normal (normalised pixels)."""
    return np.random.default_rng(seed).standard_normal((n, 3, size, size)).astype(np.float32)
