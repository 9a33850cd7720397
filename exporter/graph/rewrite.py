"""Rewrite an ONNX classifier to the adaptable-model contract (DESIGN section 3), with onnx-ir.

Given the source graph, the adapted affines (:mod:`.affines`) and its classifier head
(:mod:`.head`), :func:`rewrite` makes the graph read every adapted affine per row from a new
``theta`` input [R, P]:

* one ``Split`` cuts theta into the affines' weights and biases, each reshaped to broadcast
  against its norm's output with the rows on the batch axis;
* an explicit norm keeps normalising, its own affine replaced by ones / zeros (ORT still folds
  a BatchNorm into the convolution before it), and ``* w + b`` follows; a decomposed affine's
  Mul / Add by constants is replaced by the per-row one; a folded BatchNorm's convolution gets
  a new per-channel scale and shift (a ``FusedConv`` is split back into Conv, affine,
  activation so the affine stays before the activation);
* the shared prefix: every node that does not depend on theta runs once per image; where a
  node that does reads a tensor of the prefix, the tensor is tiled r = R / N times along its
  batch axis (copy-major, as the contract orders the rows), and a shape computed from the
  prefix's batch size (``Shape -> Gather -> Concat -> Reshape``, as torch.onnx writes a
  dynamic batch) is recomputed from the tiled tensor;
* outputs ``logits`` [R, K] (the classifier's output, before any Softmax) and ``features``
  [R, F] (the head's input, flattened).

The batch axis of every prefix tensor is read off two real runs (:mod:`.probe`), not guessed.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import (
    NameFixPass,
    RemoveUnusedNodesPass,
    TopologicalSortPass,
)

from eva0_edge.runtime.metadata import Segment

from .affines import Affine
from .probe import Probe

_ACTIVATIONS = {"Relu", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid", "Clip"}


class RewriteError(ValueError):
    """The graph cannot be made adaptable; the message names the node and what to pass."""


class _Builder:
    """Appends nodes and constants to ``graph`` (sorted topologically at the end)."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self._count = 0

    def const(self, array: np.ndarray, hint: str) -> ir.Value:
        self._count += 1
        name = f"eva0.{hint}.{self._count}"
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.shape = ir.Shape(array.shape)
        value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        self.graph.register_initializer(value)
        return value

    def op(self, op_type: str, inputs: list[ir.Value | None], attributes: dict | None = None,
           *, domain: str = "", outputs: int = 1) -> list[ir.Value]:
        self._count += 1
        node = ir.node(op_type, inputs, attributes or {}, domain=domain, num_outputs=outputs,
                       name=f"eva0.{op_type}.{self._count}")
        self.graph.append(node)
        return list(node.outputs)


def _replace_uses(old: ir.Value, new: ir.Value, keep: set[ir.Node]) -> None:
    for use in list(old.uses()):
        if use.node not in keep:
            use.node.replace_input_with(use.idx, new)


def _downstream(start: ir.Value) -> set[ir.Node]:
    seen: set[ir.Node] = set()
    frontier = [start]
    while frontier:
        value = frontier.pop()
        for use in value.uses():
            if use.node not in seen:
                seen.add(use.node)
                frontier.extend(use.node.outputs)
    return seen


class _Rewriter:
    def __init__(self, model: ir.Model, pixels: ir.Value, probes: dict[str, Probe]) -> None:
        self.model = model
        self.graph = model.graph
        self.pixels = pixels
        self.probes = probes
        self.build = _Builder(self.graph)
        self.theta = ir.Value(name="theta", type=ir.TensorType(ir.DataType.FLOAT),
                              shape=ir.Shape(["rows", None]))
        self._tiled: dict[ir.Value, ir.Value] = {}
        self._cloned: dict[ir.Value, ir.Value] = {}
        self._repeats: dict[tuple[int, int], ir.Value] = {}
        self._copies: ir.Value | None = None

    def probe(self, value: ir.Value) -> Probe:
        if value is self.pixels:
            shape = self.probes["__pixels__"].shapes
            return Probe(value.name or "", shape, True, False)
        found = self.probes.get(value.name or "")
        if found is None:
            raise RewriteError(f"no probe for tensor {value.name!r}")
        return found

    # -- theta ---------------------------------------------------------------------------
    def inject(self, affines: list[Affine]) -> tuple[list[Segment], np.ndarray]:
        self.graph.inputs.append(self.theta)
        segments, theta0, offset = [], [], 0
        for affine in affines:
            for name, array in ((affine.weight_name, affine.weight0),
                                (affine.bias_name, affine.bias0)):
                segments.append(Segment(name, offset, int(array.size), tuple(array.shape)))
                theta0.append(array.reshape(-1))
                offset += int(array.size)
        self.theta.shape = ir.Shape(["rows", offset])
        sizes = np.array([s.size for s in segments], np.int64)
        parts = self.build.op("Split", [self.theta, self.build.const(sizes, "theta_sizes")],
                              {"axis": 1}, outputs=len(segments))
        for i, affine in enumerate(affines):
            self._apply(affine, parts[2 * i], parts[2 * i + 1])
        return segments, np.concatenate(theta0).astype(np.float32)

    def _broadcast(self, affine: Affine, row: ir.Value, array: np.ndarray) -> ir.Value:
        probe = self.probe(affine.output)
        rank, batch = probe.rank, probe.batch_axis
        if batch is None:
            raise RewriteError(f"cannot find the batch axis of {affine.op} node "
                               f"{affine.node.name!r}'s output {list(probe.shapes[0])}")
        if affine.channel_axis is not None:
            target = [1] * rank
            target[affine.channel_axis] = int(array.size)
        else:
            shape = list(array.shape)
            if len(shape) > rank:
                shape = shape[len(shape) - rank:]
            target = [1] * (rank - len(shape)) + shape
        if target[batch] != 1:
            raise RewriteError(f"the affine of {affine.op} node {affine.node.name!r} runs along "
                               "the batch axis: it cannot be adapted per sample")
        target[batch] = -1
        shape_value = self.build.const(np.array(target, np.int64), "affine_shape")
        return self.build.op("Reshape", [row, shape_value])[0]

    def _apply(self, affine: Affine, weight_row: ir.Value, bias_row: ir.Value) -> None:
        weight = self._broadcast(affine, weight_row, affine.weight0)
        bias = self._broadcast(affine, bias_row, affine.bias0)
        node = affine.node
        if affine.kind == "norm":
            scale_index = 2 if node.op_type == "SkipLayerNormalization" else 1
            node.replace_input_with(scale_index, self.build.const(
                np.ones_like(affine.weight0), "unit_scale"))
            if len(node.inputs) > scale_index + 1 and node.inputs[scale_index + 1] is not None:
                node.replace_input_with(scale_index + 1, self.build.const(
                    np.zeros_like(affine.bias0), "zero_bias"))
            normalised = affine.output
        elif affine.kind == "decomposed":
            assert affine.mul is not None
            data = [v for v in affine.mul.inputs
                    if v is not None and ir.convenience.get_const_tensor(v) is None]
            normalised = data[0]
        elif node.op_type == "FusedConv":
            self._fused_conv(affine, weight, bias)
            return
        else:
            normalised = affine.output
        scaled = self.build.op("Mul", [normalised, weight])[0]
        result = self.build.op("Add", [scaled, bias])[0]
        _replace_uses(affine.output, result, {scaled.producer()})

    def _fused_conv(self, affine: Affine, weight: ir.Value, bias: ir.Value) -> None:
        """FusedConv = act(conv(x) + b [+ z]) -> act(conv(x) * w + b' [+ z])."""
        node = affine.node
        attrs = {k: v for k, v in node.attributes.items()
                 if k not in ("activation", "activation_params")}
        activation = node.attributes.get("activation")
        act = activation.as_string() if activation is not None else ""
        params = list(node.attributes["activation_params"].as_floats()) if (
            "activation_params" in node.attributes) else []
        inputs = list(node.inputs)
        conv = self.build.op("Conv", inputs[:3], {k: v.value for k, v in attrs.items()})[0]
        conv.name = f"{affine.output.name}.conv"  # before the activation: the same shape
        self.probes[conv.name] = self.probe(affine.output)
        out = self.build.op("Add", [self.build.op("Mul", [conv, weight])[0], bias])[0]
        if len(inputs) > 3 and inputs[3] is not None:
            out = self.build.op("Add", [out, inputs[3]])[0]
        if act:
            if act not in _ACTIVATIONS:
                raise RewriteError(f"FusedConv node {node.name!r} has activation {act!r}, "
                                   f"not one of {sorted(_ACTIVATIONS)}")
            out = self._activation(act, params, out)
        _replace_uses(affine.output, out, set())

    def _activation(self, act: str, params: list[float], x: ir.Value) -> ir.Value:
        if act == "LeakyRelu":
            return self.build.op(act, [x], {"alpha": params[0] if params else 0.01})[0]
        if act == "HardSigmoid":
            alpha, beta = (params + [0.2, 0.5])[:2] if len(params) < 2 else params[:2]
            return self.build.op(act, [x], {"alpha": alpha, "beta": beta})[0]
        if act == "Clip":
            low = self.build.const(np.array(params[0], np.float32), "clip_min")
            high = self.build.const(np.array(params[1], np.float32), "clip_max")
            return self.build.op(act, [x, low, high])[0]
        return self.build.op(act, [x])[0]

    # -- the shared prefix ---------------------------------------------------------------
    def copies(self) -> ir.Value:
        """r = R / N as an int64 [1] tensor."""
        if self._copies is None:
            rows = self.build.op("Shape", [self.theta], {"start": 0, "end": 1})[0]
            images = self.build.op("Shape", [self.pixels], {"start": 0, "end": 1})[0]
            self._copies = self.build.op("Div", [rows, images])[0]
        return self._copies

    def tile(self, value: ir.Value) -> ir.Value:
        if value in self._tiled:
            return self._tiled[value]
        probe = self.probe(value)
        axis = probe.batch_axis
        if axis is None:
            producer = value.producer()
            raise RewriteError(
                f"tensor {value.name!r} (from {producer.op_type if producer else 'input'} node "
                f"{producer.name if producer else ''!r}, shape {list(probe.shapes[0])} at batch "
                f"2) feeds the adapted layers, but no single axis of it is the batch: adapt "
                "only layers after it (--adapt)")
        key = (probe.rank, axis)
        if key not in self._repeats:
            before = self.build.const(np.ones(axis, np.int64), "ones")
            after = self.build.const(np.ones(probe.rank - axis - 1, np.int64), "ones")
            self._repeats[key] = self.build.op("Concat", [before, self.copies(), after],
                                               {"axis": 0})[0]
        tiled = self.build.op("Tile", [value, self._repeats[key]])[0]
        self._tiled[value] = tiled
        return tiled

    def clone_shape(self, value: ir.Value) -> ir.Value:
        """``value`` (an integer tensor computed from the prefix's batch size) recomputed
        from the tiled tensors, so it counts R rows."""
        if value in self._cloned:
            return self._cloned[value]
        producer = value.producer()
        if producer is None or value.const_value is not None or not self.probe(
                value).depends_on_batch:
            return value
        if producer.op_type in ("Shape", "Size"):
            inputs = [self.tile(producer.inputs[0])]
        else:
            inputs = [None if v is None else self.clone_shape(v) for v in producer.inputs]
        attrs = {k: v.value for k, v in producer.attributes.items()}
        outputs = self.build.op(producer.op_type, inputs, attrs, domain=producer.domain,
                                outputs=len(producer.outputs))
        for old, new in zip(producer.outputs, outputs, strict=True):
            self._cloned[old] = new
        return self._cloned[value]

    def share_prefix(self) -> set[ir.Node]:
        """Tile the prefix tensors the theta-dependent nodes read; return those nodes."""
        adapted = _downstream(self.theta)
        for node in list(adapted):
            for index, value in enumerate(node.inputs):  # the inputs as they were: the
                if value is None or value is self.theta:  # tiles made here are not revisited
                    continue
                producer = value.producer()
                if producer in adapted or (producer is None and value is not self.pixels):
                    continue
                if ir.convenience.get_const_tensor(value) is not None:
                    continue
                probe = self.probe(value)
                if not probe.depends_on_batch:
                    continue
                if probe.is_float or probe.shapes[0] != probe.shapes[1]:
                    node.replace_input_with(index, self.tile(value))
                else:
                    node.replace_input_with(index, self.clone_shape(value))
        return adapted


def rewrite(model: ir.Model, pixels: ir.Value, logits: ir.Value, head_input: ir.Value,
            affines: list[Affine], probes: dict[str, Probe]) -> tuple[
                onnx.ModelProto, list[Segment], np.ndarray, int]:
    """Make ``model`` adaptable in place (see the module docstring); return the ONNX model,
    the theta layout, theta0 [P] and the feature width F."""
    rewriter = _Rewriter(model, pixels, probes)
    segments, theta0 = rewriter.inject(affines)
    adapted = rewriter.share_prefix()
    if head_input.producer() not in adapted:
        raise RewriteError(
            f"the classifier head's input {head_input.name!r} does not depend on the adapted "
            "affines: choose affines before the head (--adapt)")
    head_probe = rewriter.probe(head_input)
    features = head_input
    if head_probe.rank != 2:
        features = rewriter.build.op("Flatten", [head_input], {"axis": 1})[0]
    width = int(np.prod(head_probe.shapes[0][1:]))
    if rewriter.probe(logits).rank != 2:
        logits = rewriter.build.op("Flatten", [logits], {"axis": 1})[0]
    if features.is_graph_output() or features is logits:
        features = rewriter.build.op("Identity", [features])[0]
    for value, name, size in ((logits, "logits", rewriter.probe(logits).shapes[0][1]),
                              (features, "features", width)):
        value.name = name
        value.type = ir.TensorType(ir.DataType.FLOAT)
        value.shape = ir.Shape(["rows", int(size)])
    pixels.name = "pixel_values"
    model.graph.outputs.clear()
    model.graph.outputs.extend([logits, features])
    for pass_ in (RemoveUnusedNodesPass(), TopologicalSortPass(), NameFixPass()):
        pass_(model)
    return _typed(ir.serde.serialize_model(model), probes), segments, theta0, width


def _typed(model: onnx.ModelProto, probes: dict[str, Probe]) -> onnx.ModelProto:
    """``model`` with a type for every intermediate tensor: ONNX shape inference where it
    knows the ops, the probed element type where it does not (contrib ops), so tools that cut
    the graph by name (the runtime's prefix / suffix split) find them all."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name for v in inferred.graph.value_info}
    known.update(v.name for v in inferred.graph.input)
    known.update(v.name for v in inferred.graph.output)
    known.update(i.name for i in inferred.graph.initializer)
    for node in inferred.graph.node:
        for name in node.output:
            if name and name not in known:
                probe = probes.get(name)
                dtype = np.dtype(probe.dtype if probe is not None else "float32")
                elem = onnx.helper.np_dtype_to_tensor_dtype(dtype)
                inferred.graph.value_info.append(
                    onnx.helper.make_tensor_value_info(name, elem, None))
                known.add(name)
    return inferred
