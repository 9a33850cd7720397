"""The device runtime: ONNX Runtime + NumPy. Never imports torch.

The Python API a user holds, imported on first use (so ``import eva0_edge.runtime`` stays
light):

    >>> from eva0_edge.runtime import AdaptiveModel
    >>> model = AdaptiveModel.load("vit.onnx", method="eva0", provider="cpu")
    >>> logits = model.step(x)  # predicts and adapts; x: [B, C, H, W] normalised float32

``AdaptiveModel`` is :class:`~eva0_edge.runtime.policy.Policy`, the adapting model as served
(its name since the first release); ``load_method`` and ``SessionSettings`` open one with the
settings as one value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveModel", "SessionSettings", "load_method"]


def __getattr__(name: str) -> Any:
    if name == "AdaptiveModel":
        from .policy import Policy

        return Policy
    if name == "load_method":
        from .methods import load_method

        return load_method
    if name == "SessionSettings":
        from .session import SessionSettings

        return SessionSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
