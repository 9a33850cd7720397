"""timm or ONNX -> adaptable ONNX exporter (timm needs torch; never imported by the device
runtime; :func:`make_adaptable`, the ONNX rewriter, needs no torch).

The names below load :mod:`.export` (and torch) on first use, so ``eva0_edge.exporter.cli`` can
register the ``export`` subcommand on an install without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_adaptable", "create_source_model", "export_model", "make_adaptable"]


def __getattr__(name: str) -> Any:
    if name == "make_adaptable":  # the graph rewriter: onnx + onnx-ir, no torch
        from .graph import make_adaptable

        return make_adaptable
    if name in __all__:
        from . import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
