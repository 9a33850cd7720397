"""Where a graph gets quantized: every input of every MatMul, Gemm and Conv.

An input that is an initializer is a *weight* (quantized per output channel); any other input is
an *activation*, classified by what produces it:
* ``twin_softmax``: the output of a Softmax (attention probabilities);
* ``twin_gelu``: the output of a GELU (the exported Erf form: x * 0.5 * (1 + erf(x / sqrt 2)));
* ``per_head``: an input of a MatMul whose two inputs are both activations (q, k^T, v of
  attention: one scale per head, axis 1 of [B, H, T, D]);
* ``uniform``: anything else (one scale per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

LAYER_OPS = ("MatMul", "Gemm", "Conv")


@dataclass(frozen=True)
class ActivationPoint:
    """Input ``index`` of node ``node`` (by name), carrying tensor ``tensor``."""

    node: str
    index: int
    tensor: str
    kind: str


@dataclass(frozen=True)
class WeightPoint:
    """An initializer used as a layer weight; ``axis`` is its output-channel axis."""

    node: str
    tensor: str
    axis: int


def _is_gelu(name: str, producers: dict[str, onnx.NodeProto], depth: int = 3) -> bool:
    """True when ``name`` comes from a Mul whose inputs reach an Erf within ``depth`` nodes."""
    node = producers.get(name)
    if node is None or node.op_type != "Mul":
        return False
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for i in n.input:
                p = producers.get(i)
                if p is None:
                    continue
                if p.op_type == "Erf":
                    return True
                nxt.append(p)
        frontier = nxt
    return False


def _weight_axis(node: onnx.NodeProto, index: int) -> int:
    """The axis of a 2-D weight (4-D for Conv) that indexes output channels."""
    if node.op_type == "Conv":
        return 0
    attrs = {a.name: a.i for a in node.attribute}
    if index == 1:  # B of A @ B: outputs along its columns (rows when transposed)
        return 0 if attrs.get("transB", 0) else 1
    return 1 if attrs.get("transA", 0) else 0


def find_points(model: onnx.ModelProto) -> tuple[list[ActivationPoint], list[WeightPoint]]:
    """Activation and weight quantization points of ``model``, in graph order."""
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    activations, weights = [], []
    for node in graph.node:
        if node.op_type not in LAYER_OPS:
            continue
        if not node.name:
            raise ValueError(f"{node.op_type} node without a name; cannot place quantizers")
        inputs = list(node.input[:2])
        both_activations = all(name not in initializers for name in inputs)
        for index, name in enumerate(inputs):
            if name in initializers:
                weights.append(WeightPoint(node.name, name, _weight_axis(node, index)))
                continue
            producer = producers.get(name)
            if producer is not None and producer.op_type == "Softmax":
                kind = "twin_softmax"
            elif _is_gelu(name, producers):
                kind = "twin_gelu"
            elif both_activations and node.op_type == "MatMul":
                kind = "per_head"
            else:
                kind = "uniform"
            activations.append(ActivationPoint(node.name, index, name, kind))
    return activations, weights
