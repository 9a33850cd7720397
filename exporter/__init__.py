"""timm -> adaptable ONNX exporter (needs torch; never imported by the device runtime)."""

from .export import build_adaptable, create_source_model, export_model

__all__ = ["build_adaptable", "create_source_model", "export_model"]
