"""PTQ4ViT-like post-training quantization (W8A8 / W6A6) of an adaptable model.

Every MatMul / Gemm / Conv gets its inputs quantized (see :mod:`points` for which quantizer
each input gets) and its weight quantized per output channel; scales come from a per-layer
search on calibration images run with theta = theta0 (:mod:`search`), whose activations are
captured in one bounded-memory pass (:mod:`capture`). The default output is an integer QDQ
graph ONNX Runtime runs with integer kernels (:mod:`qdq`); ``fake_quant`` writes the paper's
simulation instead: weights stored as float values on the k-bit grid, activation quantizers as
Div / Round / Clip / Mul (and Less / Where for twin-uniform) nodes. Norm layers and the
per-sample affine from ``theta`` stay in float either way, so the output is still an adaptable
model: same inputs, outputs and metadata, plus ``quantization``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

from .capture import Sample, capture
from .points import ActivationPoint, WeightPoint, find_points
from .qdq import OUTPUT_BITS, write_integer
from .quantizers import Quantizer, onnx_nodes, uniform
from .search import search_attention, search_linear, search_output, weight_matrix

REQUANTIZED_OPS = ("Conv",)  # ORT's integer Conv (QLinearConv) needs a quantized output


Progress = Callable[[int, int, str], None]


@dataclass
class _Searched:
    quantizers: dict[tuple[str, int], Quantizer] = field(default_factory=dict)
    weight_scales: dict[str, np.ndarray] = field(default_factory=dict)
    output_scales: dict[str, float] = field(default_factory=dict)


def _plan(nodes: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto],
          activations: list[ActivationPoint], weight_by_node: dict[str, WeightPoint],
          requantized: set[str]) -> dict:
    """The tensors the search reads, keyed (node, input index) and (node, 'output')."""
    samples = {}
    for p in activations:
        weight = weight_by_node.get(p.node)
        if weight is None:
            samples[(p.node, p.index)] = Sample(p.tensor, "images")
        else:
            shape = tuple(initializers[weight.tensor].dims)
            samples[(p.node, p.index)] = Sample(p.tensor, "rows", nodes[p.node], shape)
    for name in requantized:
        samples[(name, "output")] = Sample(nodes[name].output[0], "values")
    return samples


def _search_all(
    model: onnx.ModelProto,
    activations: list[ActivationPoint],
    weights: list[WeightPoint],
    calibration: np.ndarray,
    theta0: np.ndarray,
    bits: int,
    requantized: set[str],
    progress: Progress | None,
) -> _Searched:
    """Capture the calibration samples in one pass, then search every layer in graph order."""
    initializers = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    acts_by_node: dict[str, list[ActivationPoint]] = {}
    for point in activations:
        acts_by_node.setdefault(point.node, []).append(point)
    weight_by_node = {w.node: w for w in weights}
    rng = np.random.default_rng(0)
    if progress:
        progress(0, len(acts_by_node), "capturing calibration activations")
    values = capture(model, _plan(nodes, initializers, activations, weight_by_node, requantized),
                     calibration, theta0, rng)
    found = _Searched()
    for done, (name, acts) in enumerate(acts_by_node.items(), start=1):
        node, weight = nodes[name], weight_by_node.get(name)
        if weight is None:
            a, b = sorted(acts, key=lambda p: p.index)
            qa, qb = search_attention((a.kind, b.kind), values[(name, a.index)],
                                      values[(name, b.index)], bits, rng)
            found.quantizers[(name, a.index)], found.quantizers[(name, b.index)] = qa, qb
        else:
            (act,) = acts
            w = numpy_helper.to_array(initializers[weight.tensor]).astype(np.float32)
            bias = None
            if len(node.input) > 2 and node.input[2] in initializers:
                bias = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float32)
            w2, to_weight = weight_matrix(node, w, 1 - act.index)
            quantizer, scales = search_linear(act.kind, values[(name, act.index)], w2, bits, bias)
            found.quantizers[(name, act.index)] = quantizer
            found.weight_scales[weight.tensor] = to_weight(scales)
            if name in requantized:
                found.output_scales[name] = search_output(values[(name, "output")], OUTPUT_BITS)
        if progress:
            progress(done, len(acts_by_node), name)
    return found


def _requantized_layers(model: onnx.ModelProto, family: str,
                        activations: list[ActivationPoint], weights: list[WeightPoint]) -> set[str]:
    """Conv layers that get an 8-bit output for ORT's integer kernel. None in a ViT: its convs
    are the patch embedding, whose output is the residual stream, and one 8-bit per-tensor
    rounding of it cost 0.8 points on the shipped ViT (a few % of ViT-B's multiply-adds run
    there). In a ResNet every Conv but the stem (the one reading the image), where the convs
    are all the compute. The others keep the simulation's exact quantization on float kernels."""
    if family == "vit":
        return set()
    inputs = {i.name for i in model.graph.input}
    stem = {p.node for p in activations if p.tensor in inputs}
    with_weight = {w.node for w in weights}
    return {n.name for n in model.graph.node if n.op_type in REQUANTIZED_OPS
            and n.name in with_weight and n.name not in stem}


def _write_fake(
    model: onnx.ModelProto,
    quantizers: dict[tuple[str, int], Quantizer],
    weight_scales: dict[str, np.ndarray],
    bits: int,
) -> None:
    """The simulation encoding: float weights on the k-bit grid, quantizers as float nodes."""
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
    fake_quant: bool = False,
    progress: Progress | None = None,
) -> ModelMetadata:
    """Quantize ``model_path`` to W{bits}A{bits} with scales searched on ``calibration``
    (normalised float32 [N, C, H, W]) and write ``output``: an integer QDQ graph (:mod:`qdq`),
    or with ``fake_quant`` the float simulation. ``progress(done, total, layer)`` is called
    after each layer's search. Returns the new file's metadata."""
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    if metadata.quantization:
        raise ValueError(f"{model_path} is already quantized ({metadata.quantization['scheme']})")
    activations, weights = find_points(model)
    requantized = set() if fake_quant else _requantized_layers(
        model, metadata.family, activations, weights)
    found = _search_all(model, activations, weights, calibration, metadata.theta0, bits,
                        requantized, progress)
    metadata.quantization = {
        "scheme": "ptq4vit",
        "bits": bits,
        "encoding": "fake quant (float simulation)" if fake_quant else (
            "integer QDQ: int8 weights per output channel, uint8 activations (zero point 128; "
            "twin GELU: one asymmetric uint8 code with a searched step)"),
        "weights": "per output channel",
        "calibration_images": int(len(calibration)),
        "activation_quantizers": dict(Counter(q.kind for q in found.quantizers.values())),
        "twin_m": {kind: sorted(q.m for q in found.quantizers.values() if q.kind == kind)
                   for kind in ("twin_softmax", "twin_gelu")},
        "attention_per_head": sum(1 for p in activations if p.kind == "per_head"),
        "weight_tensors": len(found.weight_scales),
    }
    if fake_quant:
        _write_fake(model, found.quantizers, found.weight_scales, bits)
    else:
        metadata.quantization.update(write_integer(
            model, found.quantizers, weights, found.weight_scales, found.output_scales, bits))
        metadata.quantization["output_bits"] = OUTPUT_BITS
    set_metadata(model, metadata)
    onnx.checker.check_model(model)
    save_onnx(model, output)
    return metadata
