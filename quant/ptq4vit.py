"""PTQ4ViT-like post-training fake quantization (W8A8 / W6A6) of an adaptable model.

Every MatMul / Gemm / Conv gets its inputs quantized (see :mod:`points` for which quantizer
each input gets) and its weight quantized per output channel; scales come from a per-layer
search on calibration images run with theta = theta0 (:mod:`search`). Weights are stored
already fake-quantized (float values on the k-bit grid); activation quantizers are inserted as
Div / Round / Clip / Mul (and Less / Where for twin-uniform) nodes in front of the layer. Norm
layers and the per-sample affine from ``theta`` stay in float, so the output is still an
adaptable model: same inputs, outputs and metadata, plus ``quantization``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

from .points import ActivationPoint, WeightPoint, find_points
from .quantizers import Quantizer, onnx_nodes, uniform
from .search import as_matmul, search_attention, search_linear, subsample_rows


def capture(model: onnx.ModelProto, names: set[str], x: np.ndarray, theta0: np.ndarray):
    """Run the float model on ``x`` [N, C, H, W] with theta = theta0 and return the values of
    the tensors ``names`` (graph inputs or node outputs)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    inputs = {i.name for i in probe.graph.input}
    for name in sorted(names - existing - inputs):
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {"pixel_values": x, "theta": np.repeat(theta0[None], len(x), axis=0)}
    wanted = sorted(names - inputs)
    values = dict(zip(wanted, session.run(wanted, feeds), strict=True))
    values.update({name: feeds[name] for name in names & inputs})
    return values


def _search_all(
    model: onnx.ModelProto,
    activations: list[ActivationPoint],
    weights: list[WeightPoint],
    values: dict[str, np.ndarray],
    bits: int,
    progress: Callable[[str], None] | None,
) -> tuple[dict[tuple[str, int], Quantizer], dict[str, np.ndarray]]:
    initializers = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    acts_by_node: dict[str, list[ActivationPoint]] = {}
    for point in activations:
        acts_by_node.setdefault(point.node, []).append(point)
    weight_by_node = {w.node: w for w in weights}
    rng = np.random.default_rng(0)
    quantizers: dict[tuple[str, int], Quantizer] = {}
    weight_scales: dict[str, np.ndarray] = {}
    for name, acts in acts_by_node.items():
        node = nodes[name]
        if progress:
            progress(name)
        if name in weight_by_node:
            (act,) = acts
            point = weight_by_node[name]
            weight = numpy_helper.to_array(initializers[point.tensor]).astype(np.float32)
            bias = None
            if len(node.input) > 2 and node.input[2] in initializers:
                bias = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float32)
            w_index = 1 - act.index
            x2, w2, to_weight = as_matmul(node, values[act.tensor], weight, w_index)
            x2 = subsample_rows(x2, rng)
            quantizer, scales = search_linear(act.kind, x2, w2, bits, bias)
            quantizers[(name, act.index)] = quantizer
            weight_scales[point.tensor] = to_weight(scales)
        else:
            a, b = sorted(acts, key=lambda p: p.index)
            qa, qb = search_attention((a.kind, b.kind), values[a.tensor], values[b.tensor], bits)
            quantizers[(name, a.index)], quantizers[(name, b.index)] = qa, qb
    return quantizers, weight_scales


def _rewrite(
    model: onnx.ModelProto,
    quantizers: dict[tuple[str, int], Quantizer],
    weight_scales: dict[str, np.ndarray],
    bits: int,
) -> None:
    graph = model.graph
    new_nodes = []
    for node in graph.node:
        for index in range(len(node.input)):
            quantizer = quantizers.get((node.name, index))
            if quantizer is None:
                continue
            nodes, constants, out = onnx_nodes(
                quantizer, node.input[index], f"quant/{node.name}/in{index}"
            )
            new_nodes.extend(nodes)
            graph.initializer.extend(constants)
            node.input[index] = out
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for init in graph.initializer:
        if init.name in weight_scales:
            weight = numpy_helper.to_array(init).astype(np.float32)
            quantized = uniform(weight, weight_scales[init.name], bits).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(quantized, init.name))


def quantize_ptq4vit(
    model_path: str | os.PathLike,
    output: str | os.PathLike,
    bits: int,
    calibration: np.ndarray,
    progress: Callable[[str], None] | None = None,
) -> ModelMetadata:
    """Fake-quantize ``model_path`` to W{bits}A{bits} with scales searched on ``calibration``
    (normalised float32 [N, C, H, W]); writes ``output`` and returns its metadata."""
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    if metadata.quantization:
        raise ValueError(f"{model_path} is already quantized ({metadata.quantization['scheme']})")
    activations, weights = find_points(model)
    values = capture(model, {p.tensor for p in activations}, calibration, metadata.theta0)
    quantizers, weight_scales = _search_all(model, activations, weights, values, bits, progress)
    _rewrite(model, quantizers, weight_scales, bits)
    metadata.quantization = {
        "scheme": "ptq4vit",
        "bits": bits,
        "weights": "per output channel",
        "calibration_images": int(len(calibration)),
        "activation_quantizers": dict(Counter(q.kind for q in quantizers.values())),
        "attention_per_head": sum(1 for p in activations if p.kind == "per_head"),
        "weight_tensors": len(weight_scales),
    }
    set_metadata(model, metadata)
    onnx.checker.check_model(model)
    save_onnx(model, output)
    return metadata

