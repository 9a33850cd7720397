"""Black-box prompt mode: the exporter's prompt input, EVA-0-clubs and FOA / FOA-dagger."""

from __future__ import annotations

import numpy as np
import pytest


def batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.5, 1.5, (n, 3, 32, 32)).astype(np.float32)


def test_prompt_mode_refuses_models_without_a_class_token(tmp_path):
    import timm

    from eva0_edge.exporter import export_model

    model = timm.create_model("resnet18", layers=[1, 1, 1, 1], num_classes=10)
    with pytest.raises(ValueError, match="class token"):
        export_model("resnet18", tmp_path / "r.onnx", model=model, prompts=2,
                     input_size=(3, 32, 32))
