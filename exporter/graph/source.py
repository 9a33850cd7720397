"""Read a user's ONNX classifier: its image input, its batch dimension, its classifier head.

* the input: the one float graph input [N, C, H, W] (initializers listed as inputs, as old
  exporters write them, are not inputs);
* a fixed batch (a file exported for batch 1) is made dynamic: the input's dim 0 becomes
  symbolic and a ``Reshape`` of a batch tensor to a constant shape that starts with the fixed
  batch keeps the input's dim 0 instead; the probe then proves the graph runs at two batch sizes;
* the head: from the output back through shape-only ops (and a final Softmax, which is
  dropped: the runtime needs logits) to a ``Gemm``, ``MatMul`` (+ ``Add``) or 1x1 ``Conv``
  whose data input is the head input (the alignment features).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import (
    InlinePass,
    NameFixPass,
    RemoveInitializersFromInputsPass,
    TopologicalSortPass,
)

MIN_OPSET = 13
_SHAPE_ONLY = {"Identity", "Flatten", "Reshape", "Squeeze", "Cast"}
_PROBABILITIES = {"Softmax", "LogSoftmax"}


class SourceError(ValueError):
    """The file is not an image classifier the rewriter can read; the message says why."""


@dataclass
class Source:
    """The parsed source graph: ``pixels`` its image input, ``logits`` the classifier's output
    value (before any Softmax), ``head`` the head node and ``head_input`` its data input."""

    model: ir.Model
    pixels: ir.Value
    logits: ir.Value
    head: ir.Node
    head_input: ir.Value
    fixed_batch: int | None
    dropped: list[str]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.pixels.shape[1:])  # type: ignore[index]


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def read_source(proto: onnx.ModelProto, output: str | None = None) -> Source:
    """Parse ``proto``; ``output`` names the logits output when the file has several."""
    if _opset(proto) < MIN_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, 17)
        except Exception as err:  # noqa: BLE001 - the converter's errors are plain exceptions
            raise SourceError(f"the file's opset {_opset(proto)} is below {MIN_OPSET} and the "
                              f"ONNX version converter cannot lift it: {err}") from err
    model = ir.serde.deserialize_model(proto)
    for pass_ in (RemoveInitializersFromInputsPass(), InlinePass(), TopologicalSortPass(),
                  NameFixPass()):
        pass_(model)
    graph = model.graph
    images = [v for v in graph.inputs if not v.is_initializer()]
    if len(images) != 1:
        raise SourceError(f"the graph has {len(images)} inputs "
                          f"({[v.name for v in images]}): an image classifier takes one")
    pixels = images[0]
    if pixels.dtype != ir.DataType.FLOAT or pixels.shape is None or len(pixels.shape) != 4:
        raise SourceError(f"input {pixels.name!r} is {pixels.dtype} {pixels.shape}: need "
                          "float32 [N, C, H, W]")
    if not all(isinstance(d, int) for d in pixels.shape[1:]):
        raise SourceError(f"input {pixels.name!r} has dynamic sizes {list(pixels.shape)}: pin "
                          "C, H, W (re-export with a fixed image size, or "
                          "onnxruntime.tools.make_dynamic_shape_fixed)")
    outputs = list(graph.outputs)
    if output is not None:
        outputs = [v for v in outputs if v.name == output]
        if not outputs:
            raise SourceError(f"no output named {output!r}; the graph's outputs are "
                              f"{[v.name for v in graph.outputs]}")
    if len(outputs) != 1:
        raise SourceError(f"the graph has outputs {[v.name for v in outputs]}: name the logits "
                          "one (--logits NAME)")
    fixed = _pin_batch(graph, pixels)
    logits, head, dropped = _find_head(outputs[0])
    head_input = head.inputs[0]
    assert head_input is not None
    return Source(model, pixels, logits, head, head_input, fixed, dropped)


def _downstream_values(start: ir.Value) -> set[ir.Value]:
    seen = {start}
    frontier = [start]
    while frontier:
        for use in frontier.pop().uses():
            for out in use.node.outputs:
                if out not in seen:
                    seen.add(out)
                    frontier.append(out)
    return seen


def _pin_batch(graph: ir.Graph, pixels: ir.Value) -> int | None:
    """Make the batch dimension symbolic; return the fixed batch it had, if any."""
    assert pixels.shape is not None
    batch = pixels.shape[0]
    pixels.shape = ir.Shape(["batch", *pixels.shape[1:]])
    for node in graph:
        for out in node.outputs:
            out.shape = None
    for out in graph.outputs:
        out.shape = None
    if not isinstance(batch, int):
        return None
    from_pixels = _downstream_values(pixels)
    for node in graph:
        if node.op_type != "Reshape" or node.inputs[0] not in from_pixels:
            continue
        target = ir.convenience.get_const_tensor(node.inputs[1])
        if target is None:
            continue
        values = np.asarray(target.numpy()).copy()
        if values.size and values[0] == batch:
            values[0] = 0  # keep the input's dim 0 (allowzero is 0 in every exporter's file)
            name = f"{node.inputs[1].name}.dynamic_batch"
            value = ir.Value(name=name, const_value=ir.tensor(values, name=name))
            value.type = ir.TensorType(ir.DataType.INT64)
            value.shape = ir.Shape(values.shape)
            graph.register_initializer(value)
            node.replace_input_with(1, value)
    return batch


def _is_const(value: ir.Value | None) -> bool:
    return value is not None and ir.convenience.get_const_tensor(value) is not None


def _find_head(output: ir.Value) -> tuple[ir.Value, ir.Node, list[str]]:
    """(logits value, head node, the probability ops dropped) from the graph output."""
    chain: list[ir.Node] = []
    node = output.producer()
    while node is not None and node.op_type in _SHAPE_ONLY | _PROBABILITIES:
        chain.append(node)
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None:
        raise SourceError(f"output {output.name!r} is not computed from the image input")
    dropped = [f"{n.op_type} node {n.name!r}" for n in chain if n.op_type in _PROBABILITIES]
    head = node
    if node.op_type == "Add" and any(_is_const(v) for v in node.inputs):
        matmul = next((v.producer() for v in node.inputs if v is not None
                       and v.producer() is not None and v.producer().op_type == "MatMul"), None)
        head = matmul or node
    if head.op_type in ("Gemm", "MatMul") and _is_const(head.inputs[1]):
        return node.outputs[0], head, dropped  # the affine's own [N, K] output
    if head.op_type == "Conv" and _is_const(head.inputs[1]) and tuple(
            ir.convenience.get_const_tensor(head.inputs[1]).shape[2:]) == (1, 1):
        probabilities = [n for n in chain if n.op_type in _PROBABILITIES]
        logits = probabilities[-1].inputs[0] if probabilities else output
        return logits, head, dropped
    raise SourceError(
        f"output {output.name!r} comes from {node.op_type} node {node.name!r}, not a classifier "
        "head (Gemm, MatMul [+ Add] by a constant weight, or a 1x1 Conv): name the logits "
        "output (--logits NAME)")
