"""The device runtime: ONNX Runtime + NumPy. Never imports torch."""
