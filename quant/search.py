"""Per-layer scale search (PTQ4ViT-style, forward only): for each layer, candidate scales for its
input and weight quantizers are scored by the cosine similarity between the layer's float output
and its output with quantized operands, on the calibration activations; the two are searched
alternately (input, weight, input). No gradient anywhere: PTQ4ViT's Hessian-guided metric needs
one, so the forward cosine stands in for it.

Layers are reduced to ``Y = X @ W`` with X [M, K] and W [K, O]: MatMul as is, Gemm with its
transposes applied, Conv through im2col (rows = output positions). Weight scales are per output
channel (per column of W), so every column's candidates are scored on that column's output.
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view

from .quantizers import Quantizer, twin_softmax, uniform

ALPHAS = np.linspace(0.3, 1.2, 19)  # candidate scales: alpha * max|x| / (2^(k-1) - 1)
TWIN_M = range(0, 12)
MAX_ROWS = 2048


def _cosine(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    num = (a * b).sum(axis=axis)
    den = np.sqrt((a * a).sum(axis=axis) * (b * b).sum(axis=axis)) + 1e-30
    return num / den


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _im2col(x: np.ndarray, weight_shape: tuple, attrs: dict) -> np.ndarray:
    """[N, C, H, W] -> [N * H_out * W_out, C * kh * kw] for a Conv with group 1."""
    if attrs.get("group", 1) != 1 or any(d != 1 for d in attrs.get("dilations", [1, 1])):
        raise NotImplementedError("grouped or dilated Conv")
    kh, kw = weight_shape[2:]
    pads = attrs.get("pads", [0, 0, 0, 0])
    sh, sw = attrs.get("strides", [1, 1])
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    windows = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    n, c, ho, wo = windows.shape[:4]
    return windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kh * kw)


def as_matmul(node: onnx.NodeProto, x: np.ndarray, weight: np.ndarray, index: int):
    """(X [M, K], W [K, O], to_weight) where ``to_weight(scales [O])`` shapes per-column scales
    to broadcast over the original weight tensor."""
    if node.op_type == "Conv":
        cols = _im2col(x, weight.shape, _attrs(node))
        w2 = weight.reshape(weight.shape[0], -1).T
        return cols, w2, lambda s: s.reshape(-1, 1, 1, 1)
    attrs = _attrs(node)
    if node.op_type == "Gemm":
        x2 = x.T if attrs.get("transA", 0) else x
        if attrs.get("transB", 0):
            return x2, weight.T, lambda s: s.reshape(-1, 1)
        return x2, weight, lambda s: s.reshape(1, -1)
    if index != 1 or weight.ndim != 2:
        raise NotImplementedError("MatMul with a weight that is not its 2-D second input")
    return x.reshape(-1, x.shape[-1]), weight, lambda s: s.reshape(1, -1)


def subsample_rows(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """At most MAX_ROWS rows of ``x``, drawn without replacement."""
    return x if len(x) <= MAX_ROWS else x[rng.choice(len(x), MAX_ROWS, replace=False)]


def _activation_candidates(kind: str, x: np.ndarray, bits: int) -> list[Quantizer]:
    if kind in ("twin_softmax", "twin_gelu"):
        return [Quantizer(kind, bits, m=m) for m in TWIN_M]
    top = float(np.abs(x).max()) or 1.0
    return [Quantizer("uniform", bits, scale=np.float32(a * top / _qmax(bits))) for a in ALPHAS]


def search_linear(
    kind: str, x: np.ndarray, w: np.ndarray, bits: int, bias: np.ndarray | None = None,
) -> tuple[Quantizer, np.ndarray]:
    """Best input quantizer and per-column weight scales [O] for ``X @ W (+ bias)``."""
    reference = x @ w + (0 if bias is None else bias)
    top_w = np.abs(w).max(axis=0)
    top_w[top_w == 0] = 1.0
    w_scale = top_w / _qmax(bits)
    candidates = _activation_candidates(kind, x, bits)
    best_q = candidates[-1]
    for _ in range(2):
        qw = uniform(w, w_scale, bits)
        scores = [_cosine(reference, q(x) @ qw + (0 if bias is None else bias)) for q in candidates]
        best_q = candidates[int(np.argmax(scores))]
        qx = best_q(x)
        per_col = np.stack([
            _cosine(reference, qx @ uniform(w, a * top_w / _qmax(bits), bits)
                    + (0 if bias is None else bias), axis=0)
            for a in ALPHAS
        ])
        w_scale = ALPHAS[per_col.argmax(axis=0)] * top_w / _qmax(bits)
    return best_q, w_scale.astype(np.float32)


def _per_head_candidates(x: np.ndarray, bits: int) -> np.ndarray:
    """[len(ALPHAS), 1, H, 1, 1] per-head scale candidates of a [B, H, T, D] tensor."""
    if x.ndim != 4:
        raise NotImplementedError(
            f"a MatMul of two activations of rank {x.ndim}; per-head scales need [B, H, T, D]"
        )
    top = np.abs(x).max(axis=(0, 2, 3))
    top[top == 0] = 1.0
    return (ALPHAS[:, None] * top[None, :] / _qmax(bits)).reshape(len(ALPHAS), 1, -1, 1, 1)


def _per_head_cos(reference: np.ndarray, y: np.ndarray) -> np.ndarray:
    return _cosine(reference, y, axis=(0, 2, 3))


def search_attention(
    kinds: tuple[str, str], a: np.ndarray, b: np.ndarray, bits: int
) -> tuple[Quantizer, Quantizer]:
    """Quantizers for both activation inputs of ``a @ b`` ([B, H, ., .] each): per-head scales,
    chosen per head by the cosine of that head's output; twin-uniform softmax searched over m."""
    reference = a @ b
    ops = [a, b]
    current: list[Quantizer] = []
    for kind, x in zip(kinds, ops, strict=True):
        if kind == "twin_softmax":
            current.append(Quantizer(kind, bits, m=0))
        else:
            current.append(Quantizer("uniform", bits, scale=_per_head_candidates(x, bits)[-1]))
    for _ in range(2):
        for side in (0, 1):
            other = current[1 - side](ops[1 - side])
            x = ops[side]

            def output(qx: np.ndarray, side=side, other=other) -> np.ndarray:
                return qx @ other if side == 0 else other @ qx

            if kinds[side] == "twin_softmax":
                quantize = twin_softmax
                scores = [_cosine(reference, output(quantize(x, m, bits))) for m in TWIN_M]
                current[side] = Quantizer(kinds[side], bits, m=int(TWIN_M[int(np.argmax(scores))]))
                continue
            candidates = _per_head_candidates(x, bits)
            scores = np.stack([
                _per_head_cos(reference, output(uniform(x, s, bits))) for s in candidates
            ])
            best = scores.argmax(axis=0)
            scale = candidates[best, 0, np.arange(len(best)), 0, 0].reshape(1, -1, 1, 1)
            current[side] = Quantizer("uniform", bits, scale=scale.astype(np.float32))
    return current[0], current[1]

