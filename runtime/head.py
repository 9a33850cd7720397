"""The classifier head of an adaptable model, read from its graph, for activation shifting.

Every exported family ends in one affine classifier, ``logits = head_input @ W.T + b``, and its
input is a function of the ``features`` output the runtime already gets, so FOA's activation
shift (move the head input by s) costs no forward: ``head(h + s) = logits + W s``.

* ResNet-GN: the head input is the pooled output of the last stage, the ``layer4.gap`` feature
  segment itself;
* ViT (theta models): it is the final LayerNorm of the last block's class token, the LayerNorm
  applied to the ``blocks.<L-1>.out_cls`` segment (LayerNorm acts per token, so normalising the
  tapped token equals tapping the normalised one);
* prompt models: their ``head_input`` segment.

:func:`read_head` finds W, b and the LayerNorm (if any) in the graph (float initializers, or
DequantizeLinear of them in a quantized file), the classifier a Gemm, a MatMul or a 1x1 Conv,
with or without a bias (none reads as zero: optimisers and quantizers drop an all-zero one);
:meth:`LinearHead.matches` checks the reading
against a real forward before anything uses it. :func:`cached_head` parses the file once per
version and keeps the reading in the cache (``cache_dir()/head/<sha256>.npz``), as the split
sessions keep their parts: the device path does not parse the weights a second time.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .atomic import atomic_write_bytes
from .cache import cache_dir, file_digest
from .metadata import ModelMetadata
from .modelfile import load_onnx

# ops between the head's input and the pooled/normalised tensor that leave row values as they
# are, up to rounding (quantize/dequantize pairs, fake quantization); the reading is checked
# against a forward (LinearHead.matches) before it is used
_PASS_THROUGH = {
    "Reshape", "Flatten", "Squeeze", "Identity", "QuantizeLinear", "DequantizeLinear",
    "Div", "Round", "Clip", "Mul",  # fake quantization: x -> clip(round(x / s)) * s
}


class HeadError(ValueError):
    """The model's classifier head is not one affine layer over its features."""


@dataclass(frozen=True)
class LinearHead:
    """``logits = head_input(features) @ weight.T + bias``.

    weight: [K, D]; bias: [K]; segment: the feature columns the head input is read from;
    norm: (scale [D], bias [D], epsilon) of a LayerNorm applied to that segment, or None.
    """

    weight: np.ndarray
    bias: np.ndarray
    segment: slice
    norm: tuple[np.ndarray, np.ndarray, float] | None = None

    @property
    def width(self) -> int:
        """D, the width of the head input."""
        return int(self.weight.shape[1])

    def head_input(self, features: np.ndarray) -> np.ndarray:
        """[R, F] features -> [R, D] head inputs (float64)."""
        h = np.asarray(features[:, self.segment], dtype=np.float64)
        if self.norm is None:
            return h
        scale, shift, eps = self.norm
        centred = h - h.mean(axis=1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + eps) * scale + shift

    def logits(self, features: np.ndarray) -> np.ndarray:
        """[R, F] -> [R, K]: the head applied to the head inputs (float64)."""
        return self.head_input(features) @ self.weight.T + self.bias

    def matches(self, logits: np.ndarray, features: np.ndarray) -> bool:
        """Whether this reading reproduces the graph's ``logits`` [R, K] from its ``features``
        [R, F]: to 5% of the logits' scale, since a quantized file rounds the head's input
        (measured: 2e-7 float, 0.2% ViT W8A8, 0.8-1.7% W6A6); a wrong reading is off by the
        logits' own size."""
        error = np.abs(self.logits(features) - logits).max()
        return bool(error <= 0.05 * (1.0 + np.abs(logits).max()))


def read_head(model: onnx.ModelProto, metadata: ModelMetadata) -> LinearHead:
    """The head of an adaptable model (see the module docstring); HeadError naming what is not
    as expected.

    The classifier is a Gemm, a MatMul or a 1x1 Conv over the head input, its bias the
    Gemm's / Conv's own or a constant Add after it; a head without one (a zero bias dropped
    by the exporter's optimiser or by quantization, which writes a bias-less Gemm as a bare
    MatMul) reads as a zero bias. Quantize/dequantize pairs and reshapes between the layer and
    the ``logits`` output are read through, and a weight or bias may be the DequantizeLinear
    of an integer initializer (quant/'s QDQ files)."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = _Constants(graph, producers)
    if "logits" not in producers:
        raise HeadError("the graph has no 'logits' output")
    node = _row_preserving_source("logits", producers)
    bias: np.ndarray | None = None
    if node.op_type == "Add":
        node, bias = _add_of_affine(node, producers, constants)
    elif node.op_type not in _AFFINE:
        raise HeadError(f"'logits' comes from a {node.op_type} node, not an affine classifier")
    weight, own_bias, source = _affine(node, constants)
    bias = own_bias if bias is None else bias if own_bias is None else own_bias + bias
    if bias is None:
        bias = np.zeros(weight.shape[0])
    norm = _layer_norm_before(source, producers, constants)
    segments = {s.name: s for s in metadata.feature_layout}
    seg = segments.get("head_input", metadata.feature_layout[-1])
    if weight.ndim != 2 or bias.shape != (weight.shape[0],) or seg.size != weight.shape[1]:
        raise HeadError(f"the classifier weight {list(weight.shape)} does not read the "
                        f"{seg.name!r} features ({seg.size} wide)")
    return LinearHead(weight.astype(np.float64), bias.astype(np.float64),
                      slice(seg.offset, seg.offset + seg.size), norm)


# the layers a classifier head is: logits = x @ W.T (+ b)
_AFFINE = ("Gemm", "MatMul", "Conv")
# ops between the classifier layer and ``logits`` that keep each row's values, up to rounding
_ROW_PRESERVING = ("DequantizeLinear", "QuantizeLinear", "Reshape", "Flatten", "Squeeze",
                   "Identity")


def _row_preserving_source(name: str, producers: dict[str, onnx.NodeProto]) -> onnx.NodeProto:
    """The node producing tensor ``name`` (which has a producer), read through the ops of
    ``_ROW_PRESERVING`` (a quantized file rounds the logits, a 1x1 Conv head flattens them)."""
    node = producers[name]
    while node.op_type in _ROW_PRESERVING and node.input[0] in producers:
        node = producers[node.input[0]]
    return node


def _add_of_affine(
    add: onnx.NodeProto, producers: dict[str, onnx.NodeProto], constants: _Constants
) -> tuple[onnx.NodeProto, np.ndarray]:
    """(the affine layer, the bias [K]) of ``Add(layer(x), bias)``, either operand order."""
    for index in (0, 1):
        layer, other = add.input[index], add.input[1 - index]
        if layer not in producers or not constants.known(other):
            continue
        node = _row_preserving_source(layer, producers)
        if node.op_type in _AFFINE:
            return node, constants.get(other).reshape(-1)
    raise HeadError("'logits' comes from an Add that is not an affine classifier plus a "
                    "constant bias")


def _affine(
    node: onnx.NodeProto, constants: _Constants
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(weight [K, D], its own bias [K] or None, the input tensor's name) of a Gemm, MatMul or
    1x1 Conv classifier layer."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            raise HeadError("the classifier Gemm transposes its input")
        weight = constants.get(node.input[1]) * float(attrs.get("alpha", 1.0))
        if not attrs.get("transB", 0):
            weight = weight.T
        bias = (constants.get(node.input[2]).reshape(-1) * float(attrs.get("beta", 1.0))
                if has_bias else None)
        return weight, bias, node.input[0]
    if node.op_type == "MatMul":
        return constants.get(node.input[1]).T, None, node.input[0]
    weight = constants.get(node.input[1])  # Conv: [K, D, 1, 1] over a [N, D, 1, 1] input
    if weight.ndim < 3 or any(size != 1 for size in weight.shape[2:]) \
            or attrs.get("group", 1) != 1:
        raise HeadError(f"the classifier Conv has kernel {list(weight.shape[2:])} and "
                        f"{attrs.get('group', 1)} group(s); only an ungrouped 1x1 Conv is "
                        "an affine classifier")
    bias = constants.get(node.input[2]).reshape(-1) if has_bias else None
    return weight.reshape(weight.shape[:2]), bias, node.input[0]


def cached_head(path: str | os.PathLike, metadata: ModelMetadata) -> LinearHead:
    """:func:`read_head` of the file at ``path``, read from the cache after the first time."""
    cached = cache_dir() / "head" / f"{file_digest(Path(path))}.npz"
    if cached.is_file():
        with np.load(cached, allow_pickle=False) as npz:
            values = {name: npz[name] for name in npz.files}
        norm = None
        if "norm_scale" in values:
            norm = (values["norm_scale"], values["norm_bias"], float(values["norm_eps"]))
        start, stop = (int(v) for v in values["segment"])
        return LinearHead(values["weight"], values["bias"], slice(start, stop), norm)
    head = read_head(load_onnx(path), metadata)
    arrays: dict[str, Any] = {"weight": head.weight, "bias": head.bias,
              "segment": np.array([head.segment.start, head.segment.stop])}
    if head.norm is not None:
        arrays.update(norm_scale=head.norm[0], norm_bias=head.norm[1],
                      norm_eps=np.array(head.norm[2]))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(cached, buffer.getvalue())
    return head


def _layer_norm_before(
    name: str, producers: dict[str, onnx.NodeProto], constants: _Constants
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The LayerNorm whose output (one token of it) the head reads, or None when the head reads
    pooled features directly."""
    while name in producers:
        node = producers[name]
        if node.op_type == "LayerNormalization":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if len(node.input) < 3 or attrs.get("axis", -1) != -1:
                raise HeadError("the final LayerNorm has no bias or normalises more than the "
                                "last axis")
            eps = float(attrs.get("epsilon", 1e-5))
            return constants.get(node.input[1]), constants.get(node.input[2]), eps
        if node.op_type not in _PASS_THROUGH and node.op_type != "Gather":
            return None
        name = node.input[0]
    return None


class _Constants:
    """Values of graph tensors that depend on initializers only."""

    def __init__(self, graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> None:
        self.initializers = {t.name: t for t in graph.initializer}
        self.producers = producers

    def known(self, name: str) -> bool:
        """Whether tensor ``name`` is an initializer or computed from initializers by a node
        :meth:`get` reads."""
        node = self.producers.get(name)
        return name in self.initializers or (
            node is not None and node.op_type in ("Constant", "DequantizeLinear", "Identity",
                                                  "Transpose")
            and (node.op_type == "Constant" or self.known(node.input[0]))
        )

    def get(self, name: str) -> np.ndarray:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name]).astype(np.float64)
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t).astype(np.float64)
        if node is not None and node.op_type == "DequantizeLinear":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            values = self.get(node.input[0])
            scale = self.get(node.input[1])
            zero = self.get(node.input[2]) if len(node.input) > 2 and node.input[2] else 0.0
            if np.ndim(scale) == 1 and scale.size > 1:
                axis = attrs.get("axis", 1)
                shape = [1] * values.ndim
                shape[axis] = -1
                scale = scale.reshape(shape)
                zero = np.reshape(zero, shape) if np.ndim(zero) else zero
            return (values - zero) * scale
        if node is not None and node.op_type in ("Identity", "Transpose"):
            value = self.get(node.input[0])
            if node.op_type == "Transpose":
                perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
                value = np.transpose(value, perm)
            return value
        raise HeadError(f"the classifier reads {name!r}, which is not a constant of the graph")
