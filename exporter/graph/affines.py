"""Find the per-channel affines of an ONNX classifier that EVA-0 can adapt.

An *affine* is ``y = normalised * weight + bias`` with one weight and bias per channel. It is
found in every form the exporters and optimisers of the field write it:

* an explicit norm node: ``LayerNormalization`` (ai.onnx, or com.microsoft in older optimised
  files), ``SkipLayerNormalization`` (ORT's fused residual + LayerNorm), ``BatchNormalization``
  (inference mode), ``InstanceNormalization``, ``GroupNormalization`` (opset 21's per-channel
  affine; opset 18's per-group one only when groups equal channels);
* a decomposed norm: ``Mul(h, gamma) -> Add(., beta)`` with constant gamma / beta, where h is
  normalised (an explicit norm with an identity affine, as torch.onnx writes GroupNorm, or
  ``Div`` by a ``Sqrt`` / ``Mul`` by a ``Reciprocal``, as a hand-written LayerNorm lowers);
* a BatchNorm folded into its convolution (what torch.onnx's and ORT's optimisers and most
  deployment tool chains leave): ``Conv`` or ORT's ``FusedConv`` (conv + activation) whose
  output keeps a spatial map and feeds no norm. Its affine is new: a per-channel scale and
  shift after the convolution, identity (ones, zeros) at theta0. Convolutions count only in a
  graph whose norms are all BatchNorms (or that has none), so a stem or patch-embedding conv
  before a LayerNorm is never mistaken for a folded BatchNorm.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from eva0_edge.exporter.ranges import parse_range

from .probe import Probe

NORM_OPS = {
    "LayerNormalization", "SkipLayerNormalization", "BatchNormalization",
    "InstanceNormalization", "GroupNormalization",
}
CONV_OPS = {"Conv", "FusedConv"}
_PASS_THROUGH = {"Reshape", "Identity", "Squeeze", "Unsqueeze", "Cast", "Transpose"}
_AUTO_NAME = re.compile(r"^(onnx::|val_|_val_|\d+$|node_|/)")


@dataclass
class Affine:
    """One adaptable affine.

    ``kind``: ``norm`` (an explicit norm node's own scale / bias inputs), ``decomposed``
    (``mul`` and ``node`` = the Add), ``conv`` (a new scale / shift after ``node``).
    ``output``: the value that the per-sample affine's result replaces. ``weight0`` / ``bias0``:
    the source values in the shape they broadcast with against ``output`` (trailing axes).
    ``channel_axis``: for ``norm`` / ``conv``, the axis of ``output`` the parameters run along
    (None: they broadcast as ``weight0``'s shape says, aligned to the last axes).
    """

    kind: str
    node: ir.Node
    output: ir.Value
    weight_name: str
    bias_name: str
    weight0: np.ndarray
    bias0: np.ndarray
    channel_axis: int | None = None
    mul: ir.Node | None = None

    @property
    def op(self) -> str:
        return self.mul.op_type + "+Add" if self.kind == "decomposed" else self.node.op_type

    @property
    def base_name(self) -> str:
        """The name patterns of ``--adapt`` match: the weight's name without ``.weight``."""
        return self.weight_name.removesuffix(".weight").removesuffix(".scale")


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else np.asarray(tensor.numpy())


def _is_identity(scale: np.ndarray | None, bias: np.ndarray | None) -> bool:
    return scale is not None and bool(np.all(scale == 1)) and (
        bias is None or bool(np.all(bias == 0)))


def _norm_params(node: ir.Node) -> tuple[ir.Value | None, ir.Value | None]:
    """(scale, bias) inputs of an explicit norm node."""
    inputs = list(node.inputs) + [None] * 5
    if node.op_type == "SkipLayerNormalization":
        return inputs[2], inputs[3]
    return inputs[1], inputs[2]


def _normalises(node: ir.Node | None, depth: int = 0) -> bool:
    """Whether ``node``'s output is a normalised tensor (no affine yet)."""
    if node is None or depth > 4:
        return False
    if node.op_type in _PASS_THROUGH:
        return _normalises(node.inputs[0].producer() if node.inputs[0] else None, depth + 1)
    if node.op_type in NORM_OPS:
        scale, bias = _norm_params(node)
        return _is_identity(_const(scale), _const(bias))
    if node.op_type == "Div" and node.inputs[1] is not None:
        divisor = node.inputs[1].producer()
        return divisor is not None and divisor.op_type == "Sqrt"
    if node.op_type == "Mul":
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.op_type in ("Reciprocal", "Rsqrt"):
                return True
    return False


def _decomposed(add: ir.Node) -> Affine | None:
    """``Mul(h, gamma) -> Add(., beta)`` after a normalised h, else None."""
    if add.op_type != "Add" or len(add.inputs) != 2:
        return None
    for mul_index in (0, 1):
        mul_out, beta_value = add.inputs[mul_index], add.inputs[1 - mul_index]
        beta = _const(beta_value)
        mul = mul_out.producer() if mul_out is not None else None
        if beta is None or mul is None or mul.op_type != "Mul" or len(mul_out.uses()) != 1:
            continue
        for data_index in (0, 1):
            gamma = _const(mul.inputs[1 - data_index])
            data = mul.inputs[data_index]
            if gamma is None or data is None or _const(data) is not None:
                continue
            if gamma.size < 2 or beta.shape != gamma.shape or not np.issubdtype(
                    gamma.dtype, np.floating):
                continue
            if _normalises(data.producer()):
                return Affine("decomposed", add, add.outputs[0],
                              _param_name(mul.inputs[1 - data_index], mul, "weight"),
                              _param_name(beta_value, add, "bias"),
                              gamma.astype(np.float32), beta.astype(np.float32), mul=mul)
    return None


def _param_name(value: ir.Value | None, node: ir.Node, suffix: str) -> str:
    """The source tensor's own name where the exporter kept one (a state-dict key), else the
    module path of the node's scope (TorchScript's ``/layer4/layer4.1/bn2/Mul`` ->
    ``layer4.1.bn2``), else the node's name; then ``.<suffix>``."""
    name = value.name if value is not None else None
    if name and not _AUTO_NAME.match(name):
        return name
    scope = (node.name or "").strip("/").split("/")[:-1]
    if scope:
        path = scope[0]
        for part in scope[1:]:
            path = part if part.startswith(path + ".") else f"{path}.{part}"
        return f"{path}.{suffix}"
    return f"{node.name or node.op_type}.{suffix}"


def _explicit(node: ir.Node, channels: int | None) -> Affine:
    scale_value, bias_value = _norm_params(node)
    scale = _const(scale_value)
    if scale is None:
        raise AffineError(f"{node.op_type} node {node.name!r} has no constant scale")
    bias = _const(bias_value)
    bias = np.zeros_like(scale) if bias is None else bias
    axis = 1
    if node.op_type in ("LayerNormalization", "SkipLayerNormalization"):
        axis = None  # the affine runs over the normalised trailing axes: broadcast as scale
    if node.op_type == "GroupNormalization" and channels is not None and scale.size != channels:
        raise AffineError(
            f"GroupNormalization node {node.name!r} has a per-group affine (opset 18 semantics, "
            f"{scale.size} groups of {channels} channels): convert the file to opset 21 "
            "(onnx.version_converter) or adapt the norms after it")
    if node.op_type == "BatchNormalization" and len(node.outputs) > 1 and any(
            o.uses() for o in node.outputs[1:]):
        raise AffineError(f"BatchNormalization node {node.name!r} is in training mode")
    return Affine("norm", node, node.outputs[0],
                  _param_name(scale_value, node, "weight"), _param_name(bias_value, node, "bias"),
                  scale.astype(np.float32), bias.astype(np.float32), channel_axis=axis)


class AffineError(ValueError):
    """A norm or affine the rewriter cannot adapt, named."""


def find_affines(graph: ir.Graph, probes: dict[str, Probe]) -> list[Affine]:
    """Every adaptable affine of ``graph`` (topologically sorted), in graph order.

    ``probes``: the shapes of the graph's tensors (:func:`.probe.probe`): the channel count of
    a GroupNormalization, and which convolutions keep a spatial map (a 1x1 map is a
    squeeze-excite or head convolution, never a folded BatchNorm)."""
    decomposed = [a for a in (_decomposed(n) for n in graph) if a is not None]
    normalisers = set()
    for affine in decomposed:
        for value in (affine.mul.inputs if affine.mul is not None else ()):
            producer = value.producer() if value is not None else None
            while producer is not None and producer.op_type in _PASS_THROUGH:
                producer = producer.inputs[0].producer() if producer.inputs[0] else None
            if producer is not None:
                normalisers.add(producer)
    found: list[Affine] = list(decomposed)
    for node in graph:
        if node.op_type in NORM_OPS and node not in normalisers:
            probe = probes.get(node.outputs[0].name or "")
            channels = probe.shapes[0][1] if probe is not None and probe.rank >= 2 else None
            found.append(_explicit(node, channels))
    if all(a.node.op_type == "BatchNormalization" for a in found):
        found.extend(_conv(node) for node in graph if node.op_type in CONV_OPS
                     and _folded(node, probes))
    order = {node: i for i, node in enumerate(graph)}
    found.sort(key=lambda a: order[a.node])
    _unique_names(found)
    return found


def _folded(conv: ir.Node, probes: dict[str, Probe]) -> bool:
    """A convolution that may hold a folded BatchNorm: no norm reads its output and its
    output keeps a spatial map."""
    out = conv.outputs[0]
    if any(use.node.op_type in NORM_OPS for use in out.uses()):
        return False
    probe = probes.get(out.name or "")
    return probe is not None and probe.rank == 4 and probe.shapes[0][2] * probe.shapes[0][3] > 1


def _conv(node: ir.Node) -> Affine:
    weight = _const(node.inputs[1])
    if weight is None:
        raise AffineError(f"{node.op_type} node {node.name!r} has no constant weight")
    out_channels = weight.shape[0]
    base = _param_name(node.inputs[1], node, "weight").removesuffix(".weight")
    return Affine("conv", node, node.outputs[0], f"{base}.scale", f"{base}.shift",
                  np.ones(out_channels, np.float32), np.zeros(out_channels, np.float32),
                  channel_axis=1)


def _unique_names(affines: list[Affine]) -> None:
    seen: dict[str, int] = {}
    for affine in affines:
        for attr in ("weight_name", "bias_name"):
            name = getattr(affine, attr)
            if name in seen:
                seen[name] += 1
                setattr(affine, attr, f"{name}#{seen[name]}")
            else:
                seen[name] = 0


def select(affines: list[Affine], spec: str) -> list[Affine]:
    """The affines ``spec`` names: index ranges over ``affines`` (``'10-40'``, ``'3,5-7'``) or
    comma-separated name patterns matched against :attr:`Affine.base_name`
    (``'blocks.4.*,blocks.5.*'``)."""
    spec = spec.strip()
    if re.fullmatch(r"[\d\s,\-]+", spec):
        return [affines[i] for i in parse_range(spec, len(affines), "affines")]
    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = [a for a in affines if any(fnmatch.fnmatchcase(a.base_name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(a.base_name for a in affines[:6])
        raise ValueError(f"--adapt {spec!r} matches none of the {len(affines)} affines "
                         f"(they are named like {names}, ...; `eva0-edge export --onnx F "
                         "--list` prints them all)")
    return chosen
