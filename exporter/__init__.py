"""timm -> adaptable ONNX exporter (needs torch; never imported by the device runtime)."""

from .export import build_adaptable, create_source_model, export_model, parse_model_kwargs

__all__ = ["build_adaptable", "create_source_model", "export_model", "parse_model_kwargs"]
