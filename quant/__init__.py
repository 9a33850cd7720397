"""Post-training quantization of adaptable models (onnx + onnxruntime; no torch).

* ``ptq4vit``: PTQ4ViT-like searched scales at 8 or 6 bits, written as an integer QDQ graph or,
  with ``fake_quant``, as the float simulation (:mod:`.ptq4vit`);
* ``int8``: an integer-kernel QDQ encoding ONNX Runtime's CPU provider runs fast (:mod:`.int8`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.modelfile import read_metadata

SCHEMES = ("ptq4vit", "int8")


def quantize_model(
    model: str | os.PathLike,
    output: str | os.PathLike,
    bits: int,
    calibration: np.ndarray,
    scheme: str = "ptq4vit",
    fake_quant: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> ModelMetadata:
    """Quantize ``model`` to ``output`` with ``scheme`` at ``bits``; ``calibration`` holds the
    normalised calibration images float32 [N, C, H, W]. ``fake_quant`` (ptq4vit only) writes
    the float simulation instead of integer kernels; ``progress(done, total, layer)`` follows
    the ptq4vit search. Returns the new file's metadata."""
    if fake_quant and scheme != "ptq4vit":
        raise ValueError(f"fake quantization is a ptq4vit encoding; scheme {scheme!r} is "
                         "integer only")
    if read_metadata(model).is_prompt_model:
        raise ValueError(
            f"{model} is a black-box prompt model; quantize the theta model and export the "
            "prompt variant from the same weights (prompt-mode quantization is not built)"
        )
    if scheme == "ptq4vit":
        from .ptq4vit import quantize_ptq4vit

        return quantize_ptq4vit(model, output, bits, calibration, fake_quant, progress)
    if scheme == "int8":
        from .int8 import quantize_int8

        return quantize_int8(model, output, bits, calibration)
    raise ValueError(f"unknown scheme {scheme!r}; schemes: {', '.join(SCHEMES)}")
