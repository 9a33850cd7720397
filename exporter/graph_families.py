"""timm families exported through the graph rewriter: the plain model to ONNX, then
:func:`eva0_edge.exporter.graph.make_adaptable`.

Each family names its adaptable units in its own terms (timm's module names: ResNet stages
``layer1``..``layer4``, MobileNetV3 / EfficientNet ``blocks.<i>``, RegNet ``s1``..``s4``,
ConvNeXt ``stages.<i>``, Swin ``layers.<i>``) and adds the final norm before the head, where the
family has one, as one more unit. ``--adapt 3-4`` picks units 3 and 4; the rewriter adapts
every norm affine whose weight lies under them. What the MobileNetV3 and EfficientNet defaults
cost against NoAdapt is measured in ``studies/family-sets`` (``results/family-sets``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .ranges import parse_range


@dataclass(frozen=True)
class GraphFamily:
    """A timm family: ``matches(model)``, ``units(model)`` -> one name pattern per unit,
    ``default(n_units)`` -> the default ``--adapt`` range, ``unit_word`` for messages."""

    name: str
    matches: Callable[[nn.Module], bool]
    units: Callable[[nn.Module], list[str]]
    default: Callable[[int], str]
    unit_word: str

    def patterns(self, model: nn.Module, spec: str | None) -> tuple[str, str]:
        """(the ``--adapt`` range, the name patterns it selects)."""
        units = self.units(model)
        spec = spec or self.default(len(units))
        indices = parse_range(spec, len(units), self.unit_word)
        return spec, ",".join(units[i] for i in indices)


def _isinstance(path: str, name: str) -> Callable[[nn.Module], bool]:
    def matches(model: nn.Module) -> bool:
        import importlib

        cls = getattr(importlib.import_module(path), name)
        return isinstance(model, cls)

    return matches


def _batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _later_half(n: int) -> str:
    return f"{n // 2}-{n - 1}"


def _blocks_and(final: str | None) -> Callable[[nn.Module], list[str]]:
    def units(model: nn.Module) -> list[str]:
        names = [f"blocks.{i}.*" for i in range(len(model.blocks))]
        return names + ([final] if final else [])

    return units


FAMILIES: list[GraphFamily] = [
    GraphFamily(
        "resnet_bn",
        lambda m: _isinstance("timm.models.resnet", "ResNet")(m) and _batchnorm(m),
        lambda m: ["bn1"] + [f"layer{i}.*" for i in range(1, 5)],
        lambda n: "3-4", "stages (0 = stem, 1..4 = layer1..layer4)"),
    GraphFamily(
        "mobilenetv3", _isinstance("timm.models.mobilenetv3", "MobileNetV3"),
        _blocks_and(None), _later_half, "blocks (stages of blocks.<i>)"),
    GraphFamily(
        "efficientnet", _isinstance("timm.models.efficientnet", "EfficientNet"),
        _blocks_and("bn2"), _later_half, "blocks (blocks.<i>, then the head's bn2)"),
    GraphFamily(
        "regnet", _isinstance("timm.models.regnet", "RegNet"),
        lambda m: ["stem.*"] + [f"s{i}.*" for i in range(1, 5)],
        lambda n: "3-4", "stages (0 = stem, 1..4 = s1..s4)"),
    GraphFamily(
        "convnext", _isinstance("timm.models.convnext", "ConvNeXt"),
        lambda m: [f"stages.{i}.*" for i in range(len(m.stages))] + ["head.norm"],
        lambda n: f"1-{n - 1}", "stages (stages.<i>, then the head's norm)"),
    GraphFamily(
        "swin", _isinstance("timm.models.swin_transformer", "SwinTransformer"),
        lambda m: [f"layers.{i}.*" for i in range(len(m.layers))] + ["norm"],
        lambda n: f"1-{n - 1}", "stages (layers.<i>, then the final norm)"),
]


def graph_family_for(model: nn.Module) -> GraphFamily | None:
    """The first graph family that matches ``model``, or None."""
    return next((f for f in FAMILIES if f.matches(model)), None)
