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

from .quantizers import GELU_MIN, Quantizer, integer_gelu, twin_softmax, uniform

ALPHAS = np.linspace(0.3, 1.2, 10)  # candidate scales: alpha * max|x| / (2^(k-1) - 1)
TWIN_M = range(0, 12)
MAX_ROWS = 512  # rows (tokens, output positions) a linear layer is scored on
ATTENTION_IMAGES = 8  # images of an attention MatMul's operands the search scores on
ATTENTION_ROWS = 64  # rows (queries) of its first operand


def _cosine(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    num = (a * b).sum(axis=axis)
    den = np.sqrt((a * a).sum(axis=axis) * (b * b).sum(axis=axis)) + 1e-30
    return num / den


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _im2col(x: np.ndarray, weight_shape: tuple, attrs: dict, rows: int,
            rng: np.random.Generator) -> np.ndarray:
    """[N, C, H, W] -> [rows, C * kh * kw] for a Conv with group 1: at most ``rows`` output
    positions drawn without replacement (only those windows are copied)."""
    if attrs.get("group", 1) != 1 or any(d != 1 for d in attrs.get("dilations", [1, 1])):
        raise NotImplementedError("grouped or dilated Conv")
    kh, kw = weight_shape[2:]
    pads = attrs.get("pads", [0, 0, 0, 0])
    sh, sw = attrs.get("strides", [1, 1])
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    windows = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    n, c, ho, wo = windows.shape[:4]
    total = n * ho * wo
    picked = np.arange(total) if total <= rows else np.sort(rng.choice(total, rows, replace=False))
    i, j, k = np.unravel_index(picked, (n, ho, wo))
    return windows[i, :, j, k].reshape(len(picked), c * kh * kw)


def layer_rows(node: onnx.NodeProto, x: np.ndarray, weight_shape: tuple, rows: int,
               rng: np.random.Generator) -> np.ndarray:
    """At most ``rows`` rows of the layer's X [M, K] in ``Y = X @ W`` (drawn by ``rng``) from
    its input activation ``x``: im2col windows of a Conv, the rows of a Gemm's A, the
    flattened leading axes of a MatMul's input."""
    if node.op_type == "Conv":
        return _im2col(x, weight_shape, _attrs(node), rows, rng)
    if node.op_type == "Gemm" and _attrs(node).get("transA", 0):
        x = x.T
    x = x.reshape(-1, x.shape[-1])
    return x if len(x) <= rows else x[np.sort(rng.choice(len(x), rows, replace=False))]


def weight_matrix(node: onnx.NodeProto, weight: np.ndarray, index: int):
    """(W [K, O], to_weight) where ``to_weight(scales [O])`` shapes per-column scales to
    broadcast over the original weight tensor (input ``index`` of ``node``)."""
    if node.op_type == "Conv":
        return weight.reshape(weight.shape[0], -1).T, lambda s: s.reshape(-1, 1, 1, 1)
    if node.op_type == "Gemm":
        if _attrs(node).get("transB", 0):
            return weight.T, lambda s: s.reshape(-1, 1)
        return weight, lambda s: s.reshape(1, -1)
    if index != 1 or weight.ndim != 2:
        raise NotImplementedError("MatMul with a weight that is not its 2-D second input")
    return weight, lambda s: s.reshape(1, -1)


def _activation_candidates(kind: str, x: np.ndarray, bits: int) -> list[Quantizer]:
    if kind in ("twin_softmax", "twin_gelu"):
        return [Quantizer(kind, bits, m=m) for m in TWIN_M]
    top = float(np.abs(x).max()) or 1.0
    return [Quantizer("uniform", bits, scale=np.float32(a * top / _qmax(bits))) for a in ALPHAS]


def search_linear(
    kind: str, x: np.ndarray, w: np.ndarray, bits: int, bias: np.ndarray | None = None,
) -> tuple[Quantizer, np.ndarray]:
    """Best input quantizer and per-column weight scales [O] for ``X @ W (+ bias)``; a twin GELU
    quantizer also gets the step of its integer stand-in, searched with the final weights."""
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
    if kind == "twin_gelu":
        qw = uniform(w, w_scale, bits)
        steps = ALPHAS * (float(x.max()) + GELU_MIN) / (2**bits - 1)
        scores = [_cosine(reference, integer_gelu(x, s, bits) @ qw + (0 if bias is None else bias))
                  for s in steps]
        best_q.step = float(steps[int(np.argmax(scores))])
    return best_q, w_scale.astype(np.float32)


def search_output(values: np.ndarray, bits: int) -> float:
    """The symmetric per-tensor scale of a layer's output (an integer kernel's output container)
    with the best cosine between the output and its quantized value, on sampled ``values``."""
    candidates = _activation_candidates("uniform", values, bits)
    scores = [_cosine(values, q(values)) for q in candidates]
    return float(candidates[int(np.argmax(scores))].scale)


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
    kinds: tuple[str, str], a: np.ndarray, b: np.ndarray, bits: int, rng: np.random.Generator,
) -> tuple[Quantizer, Quantizer]:
    """Quantizers for both activation inputs of ``a @ b`` ([B, H, ., .] each): per-head scales,
    chosen per head by the cosine of that head's output; twin-uniform softmax searched over m.
    Scored on ATTENTION_ROWS rows of ``a`` drawn by ``rng`` (the capture keeps the first
    ATTENTION_IMAGES images; the full product of ViT-B's 32 x 12 x 197 x 197 took 25 s per
    layer)."""
    if a.ndim == 4 and a.shape[2] > ATTENTION_ROWS:
        a = a[:, :, np.sort(rng.choice(a.shape[2], ATTENTION_ROWS, replace=False))]
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

