"""The searched PTQ4ViT quantizers written as an integer QDQ graph ONNX Runtime runs with integer
kernels (the default ``ptq4vit`` encoding; ``fake_quant`` keeps the float simulation).

Per layer input (see :mod:`points`):

* weights: int8 initializers with the searched per-output-channel scales, ``DequantizeLinear``
  on the output-channel axis; 6-bit weights use [-32, 31] of the int8 container;
* ``uniform`` activations: ``QuantizeLinear`` to uint8 with zero point 128, then
  ``DequantizeLinear``. That equals the simulation's ``clip(round(x / s), -2^(k-1),
  2^(k-1) - 1) * s`` exactly; at 6 bits an integer ``Clip`` to [96, 159] narrows the code to 64
  levels. ``per_head`` scales (q, k, v of attention; shape [1, H, 1, 1]) divide first and
  multiply after a unit-scale QDQ: ORT 1.32 fuses a per-axis DQ -> MatMul into
  ``MatMulIntegerToFloat``, which then fails at run time (per-channel A is unsupported), so those
  MatMuls stay float (about 4 % of ViT-B's multiply-adds);
* ``twin_softmax`` (steps d1 = d2 / 2^m and d2 = 2^-(k-1), threshold T = 2^(k-1) d1): when
  T is on the coarse grid (m <= k - 1), the sum of two QDQ chains and no select: the fine
  codes clipped to [0, 2^(k-1)] (T's code included) plus the coarse codes clipped below at
  T / d2 and dequantized with zero point T / d2, i.e. fine(min(x, T)) + coarse(max(x, T)) - T
  (:func:`quantizers.integer_twin_softmax`). It equals the simulation but on the sliver
  [T - d1/2, T), which it rounds up to T (a coarse-grid value) where the simulation clamps it
  to T - d1: one fine step, on values the fine range cannot hold anyway. ``Less`` + ``Where``
  on the [B, H, N, N] maps cost ViT-B at B = 1 about a tenth of its kernel time. With m > k - 1
  both ranges are dequantized and recombined with ``Where`` (exact). The consumer is the
  attention MatMul, which runs in float because its other operand has per-head scales;
* ``twin_gelu``: one uint8 code (asymmetric: the smallest zero point that reaches GELU's
  minimum, -0.17) with a step searched like the twin's m, so fc2 runs an integer MatMul
  (:func:`quantizers.integer_gelu`). Twin's two ranges would need two integer MatMuls or a
  16-bit code; the stand-in has all 2^k codes on one grid, so its positive range is finer than
  the twin's and its negative range coarser (an approximation of the simulation, measured by
  the tests and the bench); at 6 bits the code is clipped to [0, 63].

ONNX Runtime fuses DequantizeLinear -> MatMul into ``MatMulIntegerToFloat``; a plain Gemm (the
head) is rewritten as MatMul + Add to fuse the same way. Conv needs a quantized output for
``QLinearConv``, so the convs the caller names (``output_scales``: a ResNet's, not the stem)
get an 8-bit uint8 output QDQ with a scale searched on the calibration outputs (an extra
rounding the simulation does not have, 8-bit at every weight width: it is the kernel's output
container).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .points import WeightPoint
from .quantizers import (
    NodeBuilder,
    Quantizer,
    gelu_zero_point,
    twin_on_coarse_grid,
    uniform_codes,
)

ZERO_POINT = 128
OUTPUT_BITS = 8


class _Graph(NodeBuilder):
    """Nodes of the integer encoding: :class:`NodeBuilder` plus QDQ chains."""

    def qdq(self, x: str, prefix: str, scale: np.ndarray, zero: np.ndarray,
            clip: tuple[int, int] | None, axis: int | None = None, out: str | None = None,
            dequantize_zero: np.ndarray | None = None) -> str:
        """QuantizeLinear (uint8) [-> integer Clip] -> DequantizeLinear of tensor ``x``, into
        tensor ``out`` (a fresh name by default); ``dequantize_zero``: the DequantizeLinear's
        zero point when it differs from the QuantizeLinear's (the codes come back shifted)."""
        attrs = {} if axis is None else {"axis": axis}
        s = self.const(prefix, "scale", np.asarray(scale, np.float32))
        z = self.const(prefix, "zero_point", np.asarray(zero, np.uint8))
        q = self.op("QuantizeLinear", [x, s, z], prefix, "quantize", **attrs)
        if clip is not None:
            low = self.const(prefix, "low", np.uint8(clip[0]))
            high = self.const(prefix, "high", np.uint8(clip[1]))
            q = self.op("Clip", [q, low, high], prefix, "clip")
        if dequantize_zero is not None:
            z = self.const(prefix, "dequantize_zero_point", np.asarray(dequantize_zero, np.uint8))
        return self.op("DequantizeLinear", [q, s, z], prefix, "dequantize", out, **attrs)


def _symmetric_clip(bits: int) -> tuple[int, int] | None:
    levels = 2 ** (bits - 1)
    return None if bits == 8 else (ZERO_POINT - levels, ZERO_POINT + levels - 1)


def _activation(g: _Graph, quantizer: Quantizer, x: str, prefix: str) -> str:
    bits = quantizer.bits
    levels = 2 ** (bits - 1)
    if quantizer.kind == "uniform":
        scale = np.asarray(quantizer.scale, np.float32)
        if scale.size == 1:
            return g.qdq(x, prefix, scale.reshape(()), np.uint8(ZERO_POINT), _symmetric_clip(bits))
        s = g.const(prefix, "head_scale", scale)
        codes = g.qdq(g.op("Div", [x, s], prefix, "per_head"), prefix, np.float32(1.0),
                      np.uint8(ZERO_POINT), _symmetric_clip(bits))
        return g.op("Mul", [codes, s], prefix, "dequantize_heads")
    if quantizer.kind == "twin_softmax":
        d2 = 1.0 / levels
        d1 = d2 / 2**quantizer.m
        if twin_on_coarse_grid(quantizer):  # T = edge x d2: the sum form, no select
            edge = levels >> quantizer.m
            fine = g.qdq(x, prefix, np.float32(d1), np.uint8(0), (0, levels))
            above = g.qdq(x, prefix, np.float32(d2), np.uint8(0), (edge, levels - 1),
                          dequantize_zero=np.uint8(edge))
            return g.op("Add", [fine, above], prefix, "twin")
        fine = g.qdq(x, prefix, np.float32(d1), np.uint8(0), (0, levels - 1))
        coarse = g.qdq(x, prefix, np.float32(d2), np.uint8(0), (0, levels - 1))
        in_fine = g.op("Less", [x, g.const(prefix, "threshold", np.float32(levels * d1))],
                       prefix, "in_r1")
        return g.op("Where", [in_fine, fine, coarse], prefix, "twin")
    if quantizer.kind == "twin_gelu":
        if quantizer.step is None:
            raise ValueError("a twin_gelu quantizer needs its searched integer step "
                             "(search_linear sets it)")
        clip = None if bits == 8 else (0, 2**bits - 1)
        return g.qdq(x, prefix, np.float32(quantizer.step),
                     np.uint8(gelu_zero_point(quantizer.step)), clip)
    raise ValueError(f"unknown quantizer kind {quantizer.kind!r}")


def activation_nodes(quantizer: Quantizer, x: str, prefix: str) -> tuple[list, list, str]:
    """(nodes, initializers, output name) of ``quantizer``'s integer encoding on tensor ``x``
    (the counterpart of :func:`quantizers.onnx_nodes` for the simulation)."""
    g = _Graph()
    out = _activation(g, quantizer, x, prefix)
    return g.nodes, g.initializers, out


def _plain_gemm(node: onnx.NodeProto) -> bool:
    """A Gemm that is ``A @ B(^T) + C`` (no transA, alpha = beta = 1): rewritable as MatMul."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == "Gemm" and not attrs.get("transA", 0)
            and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0)


def write_integer(
    model: onnx.ModelProto,
    quantizers: dict[tuple[str, int], Quantizer],
    weights: list[WeightPoint],
    weight_scales: dict[str, np.ndarray],
    output_scales: dict[str, float],
    bits: int,
) -> dict[str, int]:
    """Rewrite ``model`` in place: integer weights, QDQ activations, a plain Gemm as MatMul +
    Add (so it fuses into ``MatMulIntegerToFloat``), and an 8-bit output QDQ on every node in
    ``output_scales`` (node name -> scale). Returns counts for the metadata."""
    graph = model.graph
    g = _Graph()
    by_name = {i.name: i for i in graph.initializer}
    nodes = {n.name: n for n in graph.node}
    as_matmul = {p.node for p in weights if _plain_gemm(nodes[p.node])}
    dequantized: dict[str, str] = {}
    for point in weights:
        weight = numpy_helper.to_array(by_name[point.tensor]).astype(np.float32)
        scales = weight_scales[point.tensor]
        codes, axis = uniform_codes(weight, scales, bits).astype(np.int8), point.axis
        if point.node in as_matmul and axis == 0:  # B^T stored [N, K]: store B [K, N]
            codes, axis = codes.T, 1
        prefix = f"quant/{point.tensor}"
        w = g.const(prefix, "int8", codes)
        s = g.const(prefix, "scale", scales.reshape(-1).astype(np.float32))
        z = g.const(prefix, "zero_point", np.zeros(scales.size, np.int8))
        dequantized[point.node] = g.op("DequantizeLinear", [w, s, z], prefix, "dequantize",
                                       axis=axis)
    new_nodes = list(g.nodes)
    g.nodes.clear()
    weight_of = {p.node: p.tensor for p in weights}
    for node in graph.node:
        for index, name in enumerate(node.input):
            quantizer = quantizers.get((node.name, index))
            if quantizer is not None:
                node.input[index] = _activation(g, quantizer, name, f"quant/{node.name}/in{index}")
            elif weight_of.get(node.name) == name:
                node.input[index] = dequantized[node.name]
        if node.name in as_matmul:
            product = g.op("MatMul", list(node.input[:2]), f"quant/{node.name}", "matmul")
            if len(node.input) > 2 and node.input[2]:
                g.op("Add", [product, node.input[2]], f"quant/{node.name}", "bias",
                     out=node.output[0])
            else:
                g.nodes[-1].output[0] = node.output[0]
        else:
            g.nodes.append(node)
        if node.name in output_scales:
            raw = node.output[0]
            node.output[0] = f"{raw}/float"
            g.qdq(node.output[0], f"quant/{node.name}/out", np.float32(output_scales[node.name]),
                  np.uint8(ZERO_POINT), None, out=raw)
        new_nodes.extend(g.nodes)
        g.nodes.clear()
    del graph.node[:]
    graph.node.extend(new_nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [i for i in graph.initializer if i.name in used or i.name not in weight_of.values()]
    del graph.initializer[:]
    graph.initializer.extend(kept + g.initializers)
    approximations = []
    if any(q.kind == "twin_gelu" for q in quantizers.values()):
        approximations.append("twin GELU as one asymmetric code with a searched step")
    summed = sum(1 for q in quantizers.values()
                 if q.kind == "twin_softmax" and twin_on_coarse_grid(q))
    if summed:
        approximations.append(f"{summed} twin softmax quantizers as a sum of two codes: "
                              "[T - d1/2, T) rounds up to T")
    if output_scales:
        approximations.append(f"{len(output_scales)} Conv outputs rounded to 8 bits")
    return {"integer_weights": len(weights), "gemm_as_matmul": len(as_matmul),
            "output_requantized": len(output_scales),
            "approximations_of_the_simulation": approximations}
