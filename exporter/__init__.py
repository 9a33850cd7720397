"""timm -> adaptable ONNX exporter (needs torch; never imported by the device runtime).

The names below load :mod:`.export` (and torch) on first use, so ``eva0_edge.exporter.cli`` can
register the ``export`` subcommand on an install without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_adaptable", "create_source_model", "export_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
