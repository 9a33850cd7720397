"""Fast int8: a QDQ encoding that ONNX Runtime's CPU provider runs with integer kernels.

``onnxruntime.quantization.quantize_static`` does the work: MatMul (ViT) or Conv + MatMul
(ResNet) inputs quantized, activations uint8 with zero point 128 (symmetric), weights int8
(symmetric, per tensor), min-max calibration on the calibration images with theta = theta0.
Measured on AVX2 without VNNI (see the issue): that encoding keeps ORT's integer MatMul, while
int8 activations fell back to float.

6 bit: the same encoding on a 6-bit grid, written by hand on top of quantize_static's output:
activation scales widened so the calibrated range maps to 32 levels either side of 128 and an
integer Clip to [96, 159] after every activation QuantizeLinear; weights re-quantized to
[-32, 31] inside their int8 container. Integer Clip keeps the integer kernels (a float
Div/Round/Clip/Mul does not).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

CALIBRATION_BATCH = 8


class _Reader(CalibrationDataReader):
    """Feeds the calibration images in batches, theta = theta0 for every row."""

    def __init__(self, images: np.ndarray, theta0: np.ndarray) -> None:
        self._batches = iter(
            {
                "pixel_values": images[i : i + CALIBRATION_BATCH],
                "theta": np.repeat(theta0[None], len(images[i : i + CALIBRATION_BATCH]), 0),
            }
            for i in range(0, len(images), CALIBRATION_BATCH)
        )

    def get_next(self) -> dict | None:
        return next(self._batches, None)


def _to_six_bits(model: onnx.ModelProto) -> int:
    """Narrow a uint8/int8 QDQ model to 6-bit grids in place; returns the clips inserted."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    new_nodes, clips, rescaled = [], 0, set()
    low = helper.make_tensor("quant6/low", onnx.TensorProto.UINT8, [], [96])
    high = helper.make_tensor("quant6/high", onnx.TensorProto.UINT8, [], [159])
    graph.initializer.extend([low, high])
    for node in graph.node:
        new_nodes.append(node)
        if (node.op_type == "DequantizeLinear" and node.input[0] in initializers
                and initializers[node.input[0]].data_type == onnx.TensorProto.INT8
                and node.input[0] not in rescaled):  # weights; int32 biases keep their value
            rescaled.add(node.input[0])
            weight = initializers[node.input[0]]
            scale = initializers[node.input[1]]
            q8 = numpy_helper.to_array(weight).astype(np.float32)
            s8 = numpy_helper.to_array(scale).astype(np.float32)
            real = q8 * s8
            s6 = np.maximum(np.abs(real).max() / 31.0, 1e-12).astype(np.float32)
            q6 = np.clip(np.round(real / s6), -32, 31).astype(np.int8)
            weight.CopyFrom(numpy_helper.from_array(q6, weight.name))
            scale.CopyFrom(numpy_helper.from_array(np.asarray(s6, np.float32), scale.name))
        elif node.op_type == "QuantizeLinear" and node.input[0] not in initializers:
            scale = initializers[node.input[1]]
            if scale.name not in rescaled:  # Q and its DQ share the scale: widen it once
                rescaled.add(scale.name)
                s8 = numpy_helper.to_array(scale).astype(np.float32)
                widened = (s8 * 127.0 / 31.0).astype(np.float32)
                scale.CopyFrom(numpy_helper.from_array(widened, scale.name))
            out = node.output[0]
            clipped = f"{out}/clip6"
            new_nodes.append(helper.make_node(
                "Clip", [clipped + "_in", low.name, high.name], [clipped], name=clipped
            ))
            node.output[0] = clipped + "_in"
            for consumer in consumers.get(out, []):
                for i, name in enumerate(consumer.input):
                    if name == out:
                        consumer.input[i] = clipped
            clips += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    return clips


def quantize_int8(
    model_path: str | os.PathLike,
    output: str | os.PathLike,
    bits: int,
    calibration: np.ndarray,
) -> ModelMetadata:
    """Write an integer-kernel QDQ model of ``model_path`` at 8 or 6 bits (see module doc)."""
    if bits not in (6, 8):
        raise ValueError(f"the int8 scheme encodes 8 or 6 bits, got {bits}")
    metadata = read_metadata(model_path)
    if metadata.quantization:
        raise ValueError(f"{model_path} is already quantized ({metadata.quantization['scheme']})")
    ops = ["MatMul"] if metadata.family == "vit" else ["Conv", "MatMul", "Gemm"]
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "int8.onnx"
        source = Path(model_path)
        folds = any(node.op_type == "BatchNormalization" for node in load_onnx(source).graph.node)
        if folds:
            # fold every BatchNorm into its convolution first (ORT's basic optimisations, as
            # onnxruntime.quantization recommends), so no float BatchNorm sits between the
            # integer convolutions; the adapted ones keep their per-row affine after the Conv.
            # A folded weight carries the BatchNorm's per-channel scale: quantize it per channel
            source = Path(tmp) / "folded.onnx"
            quant_pre_process(str(model_path), str(source), skip_symbolic_shape=True)
        quantize_static(
            str(source), str(staged), _Reader(calibration, metadata.theta0),
            quant_format=QuantFormat.QDQ, op_types_to_quantize=ops, per_channel=folds,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "MatMulConstBOnly": True},
        )
        model = load_onnx(staged)
    clips = _to_six_bits(model) if bits == 6 else 0
    metadata.quantization = {
        "scheme": "int8",
        "bits": bits,
        "encoding": "QDQ: uint8 activations (zero point 128), int8 weights, per "
                    + ("channel (BatchNorm folded)" if folds else "tensor"),
        "ops": ops,
        "calibration_images": int(len(calibration)),
        "six_bit_clips": clips,
    }
    set_metadata(model, metadata)
    save_onnx(model, output)
    return metadata
