"""Fake quantizers (quantize then dequantize, in float), as NumPy functions for the scale search
and as ONNX node sequences for the quantized graph. Both compute exactly the same thing.

* uniform: symmetric signed k-bit, ``q = clip(round(x / s), -2^(k-1), 2^(k-1) - 1) * s``; ``s``
  is a scalar, or has a shape that broadcasts along one axis (per output channel, per head);
* twin uniform (PTQ4ViT, Yuan et al. 2022) splits the k-bit code into one range bit and k-1
  value bits over two uniform ranges:
  - post-softmax values in [0, 1]: R2 = [0, 1] with step 2^(1-k), R1 = [0, 2^(k-1) d1) with a
    finer step d1 = 2^(1-k) / 2^m; values below R1's end use R1;
  - post-GELU values in [-0.17, inf): R1 = [-2^(k-1) d1, 0] for the negative part with
    d1 = 0.17 / 2^(k-1) (GELU's minimum is -0.170), R2 = [0, (2^(k-1) - 1) d2] for the positive
    part with d2 = 2^m d1, so the two steps differ by a power of two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

GELU_MIN = 0.17


def uniform_codes(x: np.ndarray, scale: np.ndarray | float, bits: int) -> np.ndarray:
    """The symmetric signed k-bit codes ``clip(round(x / scale), -2^(k-1), 2^(k-1) - 1)``
    (float values; the integer encoding stores them as int8)."""
    return np.clip(np.round(x / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def uniform(x: np.ndarray, scale: np.ndarray | float, bits: int) -> np.ndarray:
    """Symmetric signed k-bit fake quantization of ``x`` with step ``scale``."""
    return uniform_codes(x, scale, bits) * scale


def _clipped(x: np.ndarray, scale: float, low: int, high: int) -> np.ndarray:
    return np.clip(np.round(x / scale), low, high) * scale


def twin_softmax(x: np.ndarray, m: int, bits: int) -> np.ndarray:
    """Twin-uniform fake quantization of post-softmax values (see the module docstring)."""
    levels = 2 ** (bits - 1)
    d2 = 1.0 / levels
    d1 = d2 / 2**m
    return np.where(
        x < levels * d1, _clipped(x, d1, 0, levels - 1), _clipped(x, d2, 0, levels - 1)
    )


def twin_on_coarse_grid(quantizer: Quantizer) -> bool:
    """Whether a twin softmax quantizer's threshold T = 2^(k-1) d1 is a point of its coarse grid
    (m <= k - 1): then its integer encoding is a sum of two codes (:func:`integer_twin_softmax`)."""
    return quantizer.kind == "twin_softmax" and quantizer.m <= quantizer.bits - 1


def integer_twin_softmax(x: np.ndarray, m: int, bits: int) -> np.ndarray:
    """The integer encoding of twin softmax quantization when m <= k - 1:
    fine(min(x, T)) + coarse(max(x, T)) - T with the fine codes allowed to reach T. Equal to
    :func:`twin_softmax` but on [T - d1/2, T), which goes to T instead of T - d1."""
    levels = 2 ** (bits - 1)
    d2 = 1.0 / levels
    d1 = d2 / 2**m
    edge = levels >> m
    return _clipped(x, d1, 0, levels) + (np.clip(np.round(x / d2), edge, levels - 1) - edge) * d2


def twin_gelu(x: np.ndarray, m: int, bits: int) -> np.ndarray:
    """Twin-uniform fake quantization of post-GELU values (see the module docstring)."""
    levels = 2 ** (bits - 1)
    d1 = GELU_MIN / levels
    d2 = d1 * 2**m
    return np.where(x < 0, _clipped(x, d1, -levels, 0), _clipped(x, d2, 0, levels - 1))


def gelu_zero_point(step: float) -> int:
    """The smallest zero point whose codes reach GELU's minimum (-0.17) with ``step``."""
    return math.ceil(GELU_MIN / step - 1e-9)


def integer_gelu(x: np.ndarray, step: float, bits: int) -> np.ndarray:
    """The integer encoding's stand-in for twin-uniform GELU quantization: one unsigned k-bit
    code with ``step`` and zero point :func:`gelu_zero_point` (asymmetric uniform)."""
    zero = gelu_zero_point(step)
    return (np.clip(np.round(x / step) + zero, 0, 2**bits - 1) - zero) * step


@dataclass
class Quantizer:
    """A chosen activation quantizer. ``kind``: 'uniform' (``scale``: scalar, or an array
    broadcasting over the tensor, e.g. [1, H, 1, 1] per head), 'twin_softmax' or 'twin_gelu'
    (``m``: the power-of-two ratio of the two steps; ``step``: the searched step of the integer
    encoding's one-code stand-in for twin GELU, see :func:`integer_gelu`)."""

    kind: str
    bits: int
    scale: np.ndarray | None = None
    m: int = 0
    step: float | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "uniform":
            return uniform(x, self.scale, self.bits)
        if self.kind == "twin_softmax":
            return twin_softmax(x, self.m, self.bits)
        if self.kind == "twin_gelu":
            return twin_gelu(x, self.m, self.bits)
        raise ValueError(f"unknown quantizer kind {self.kind!r}")

    def describe(self) -> dict:
        out = {"kind": self.kind, "bits": self.bits}
        if self.kind == "uniform":
            out["scale"] = np.asarray(self.scale).reshape(-1).tolist()
        else:
            out["m"] = self.m
        if self.step is not None:
            out["integer_step"] = self.step
        return out


class NodeBuilder:
    """Collects ONNX nodes and initializers under unique names ``<prefix>/<what>_<n>``."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0

    def name(self, prefix: str, what: str) -> str:
        self._count += 1
        return f"{prefix}/{what}_{self._count}"

    def const(self, prefix: str, what: str, value: np.ndarray) -> str:
        """An initializer holding ``value`` (its dtype kept); returns its name."""
        name = self.name(prefix, what)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], prefix: str, what: str,
           out: str | None = None, **attrs) -> str:
        """A node writing tensor ``out`` (a fresh name by default); returns that name."""
        out = out or self.name(prefix, what)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _fake(b: NodeBuilder, prefix: str, x: str, scale, low: float, high: float) -> str:
    """clip(round(x / scale), low, high) * scale as ONNX nodes."""
    s = b.const(prefix, "scale", np.asarray(scale, np.float32))
    q = b.op("Round", [b.op("Div", [x, s], prefix, "div")], prefix, "round")
    q = b.op("Clip", [q, b.const(prefix, "low", np.float32(low)),
                      b.const(prefix, "high", np.float32(high))], prefix, "clip")
    return b.op("Mul", [q, s], prefix, "dequant")


def onnx_nodes(quantizer: Quantizer, x: str, prefix: str) -> tuple[list, list, str]:
    """(nodes, initializers, output name) computing ``quantizer`` on tensor ``x``."""
    b = NodeBuilder()
    bits = quantizer.bits
    levels = 2 ** (bits - 1)
    if quantizer.kind == "uniform":
        out = _fake(b, prefix, x, quantizer.scale, -levels, levels - 1)
    elif quantizer.kind == "twin_softmax":
        d2 = 1.0 / levels
        d1 = d2 / 2**quantizer.m
        fine = _fake(b, prefix, x, d1, 0, levels - 1)
        coarse = _fake(b, prefix, x, d2, 0, levels - 1)
        threshold = b.const(prefix, "threshold", np.float32(levels * d1))
        cond = b.op("Less", [x, threshold], prefix, "in_r1")
        out = b.op("Where", [cond, fine, coarse], prefix, "twin")
    elif quantizer.kind == "twin_gelu":
        d1 = GELU_MIN / levels
        d2 = d1 * 2**quantizer.m
        negative = _fake(b, prefix, x, d1, -levels, 0)
        positive = _fake(b, prefix, x, d2, 0, levels - 1)
        cond = b.op("Less", [x, b.const(prefix, "zero", np.float32(0.0))], prefix, "negative")
        out = b.op("Where", [cond, negative, positive], prefix, "twin")
    else:
        raise ValueError(f"unknown quantizer kind {quantizer.kind!r}")
    return b.nodes, b.initializers, out

