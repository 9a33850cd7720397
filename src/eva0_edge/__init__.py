"""eva0-edge: backprop-free test-time adaptation (EVA-0) on ONNX Runtime.

The product lives in the sub-packages: ``eva0_edge.runtime`` (the device runtime, no torch),
``eva0_edge.exporter`` (timm -> adaptable ONNX), ``eva0_edge.quant`` and ``eva0_edge.bench``.
"""

__version__ = "0.1.0"
