"""Architecture families the exporter knows: how to split a timm model into a shared prefix and
an adapted suffix, which norms it adapts, and which features it taps for alignment.

A family is registered by name (like timm's model registry) and matched against a built model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from .norms import FastGroupNorm, PerSampleGroupNorm, PerSampleLayerNorm, ThetaSource

_FAMILIES: dict[str, type[Family]] = {}


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family available to :func:`family_for`."""
    _FAMILIES[cls.name] = cls
    return cls


def family_for(model: nn.Module) -> type[Family]:
    """The family class that can export ``model``; ValueError naming the known ones otherwise."""
    for cls in _FAMILIES.values():
        if cls.matches(model):
            return cls
    from .graph_families import FAMILIES

    known = sorted(_FAMILIES) + [f.name for f in FAMILIES]
    raise ValueError(
        f"cannot export {type(model).__name__}: known families are {known}; any other "
        "classifier exports to ONNX itself (torch.onnx.export) and comes in with "
        "`eva0-edge export --onnx model.onnx`"
    )


@dataclass(frozen=True)
class ParamSlot:
    """One adapted tensor: its state-dict key, offset in theta, and shape."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(torch.Size(self.shape).numel())


class Family(ABC):
    """Splits a timm model into prefix (run once per image) and suffix (run per theta row)."""

    name: str = ""

    def __init__(self, model: nn.Module, adapt: list[int]) -> None:
        self.model = model
        self.adapt = adapt
        self.source = ThetaSource()
        self.slots: list[ParamSlot] = []

    @staticmethod
    @abstractmethod
    def matches(model: nn.Module) -> bool: ...

    @classmethod
    @abstractmethod
    def default_adapt(cls, model: nn.Module) -> str: ...

    @classmethod
    @abstractmethod
    def num_units(cls, model: nn.Module) -> int:
        """How many blocks/stages --adapt indexes."""

    @abstractmethod
    def install(self) -> None:
        """Replace the adapted norms by per-sample ones and fill ``self.slots``."""

    @abstractmethod
    def prefix(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Layers before the first adapted one: ([N, ...] hidden, [N, f] feature taps)."""

    @abstractmethod
    def suffix(self, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rest, per theta row: ([R, K] logits, [R, f] feature taps)."""

    @abstractmethod
    def feature_names(self) -> list[str]:
        """The name of every feature tap, in output order (widths are read off a dry run)."""

    @abstractmethod
    def prefix_description(self) -> str: ...

    def _replace(self, qualified_name: str, norm: nn.Module, per_sample_cls: type) -> None:
        params = dict(norm.named_parameters())
        if set(params) != {"weight", "bias"}:
            raise ValueError(f"{qualified_name} has no affine weight and bias to adapt")
        w_off = sum(s.size for s in self.slots)
        self.slots.append(ParamSlot(f"{qualified_name}.weight", w_off, tuple(norm.weight.shape)))
        b_off = w_off + norm.weight.numel()
        self.slots.append(ParamSlot(f"{qualified_name}.bias", b_off, tuple(norm.bias.shape)))
        parent_name, _, child = qualified_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, per_sample_cls(norm, self.source, w_off, b_off))

    def theta0(self, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flat [P] vector of the source parameters, in slot order."""
        return torch.cat([state_dict[s.name].detach().reshape(-1).float() for s in self.slots])


def _cls_or_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if getattr(model, "has_class_token", False):
        return x[:, 0]
    return x[:, getattr(model, "num_prefix_tokens", 0) :].mean(dim=1)


@register_family
class VitFamily(Family):
    """timm VisionTransformer: adapts norm1/norm2 of the chosen blocks; taps the CLS token after
    every block (the residual stream the next LayerNorm sees)."""

    name = "vit"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer) and isinstance(
            model.blocks[0].norm1, nn.LayerNorm
        )

    @classmethod
    def num_units(cls, model: nn.Module) -> int:
        return len(model.blocks)

    @classmethod
    def default_adapt(cls, model: nn.Module) -> str:
        depth = len(model.blocks)
        if depth >= 9:
            return "2-8"
        return f"{min(1, depth - 1)}-{max(min(1, depth - 1), depth - 2)}"

    def install(self) -> None:
        for i in self.adapt:
            for norm_name in ("norm1", "norm2"):
                norm = getattr(self.model.blocks[i], norm_name)
                self._replace(f"blocks.{i}.{norm_name}", norm, PerSampleLayerNorm)

    def prefix(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m = self.model
        x = m.patch_embed(x)
        x = m._pos_embed(x)
        x = m.patch_drop(x)
        x = m.norm_pre(x)
        taps = []
        for blk in m.blocks[: self.adapt[0]]:
            x = blk(x)
            taps.append(_cls_or_mean(m, x))
        return x, taps

    def suffix(self, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m = self.model
        taps = []
        for blk in m.blocks[self.adapt[0] :]:
            h = blk(h)
            taps.append(_cls_or_mean(m, h))
        h = m.norm(h)
        return m.forward_head(h), taps

    def feature_names(self) -> list[str]:
        return [f"blocks.{i}.out_cls" for i in range(len(self.model.blocks))]

    def prefix_description(self) -> str:
        first = self.adapt[0]
        return "patch_embed" + (f" + blocks.0-{first - 1}" if first > 0 else "")


@register_family
class ResNetGNFamily(Family):
    """timm ResNet with GroupNorm: adapts every GroupNorm affine of the chosen stages
    (layer1..layer4 are stages 1..4); taps the global average pool of each stage's output."""

    name = "resnet_gn"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        from timm.models.resnet import ResNet

        return isinstance(model, ResNet) and isinstance(model.bn1, nn.GroupNorm)

    @classmethod
    def num_units(cls, model: nn.Module) -> int:
        return 5  # index 0 is the stem, 1..4 the stages; --adapt names stages 1..4

    @classmethod
    def default_adapt(cls, model: nn.Module) -> str:
        return "1-3"

    def _stages(self) -> list[nn.Module]:
        return [self.model.layer1, self.model.layer2, self.model.layer3, self.model.layer4]

    def install(self) -> None:
        if self.adapt[0] == 0:
            raise ValueError("ResNet --adapt names stages 1..4 (layer1..layer4), not the stem")
        adapted = {f"layer{i}" for i in self.adapt}
        for name, module in list(self.model.named_modules()):
            if not isinstance(module, nn.GroupNorm):
                continue
            if name.split(".")[0] in adapted:
                self._replace(name, module, PerSampleGroupNorm)
            else:
                parent_name, _, child = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                setattr(parent, child, FastGroupNorm(module))

    def prefix(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m = self.model
        x = m.act1(m.bn1(m.conv1(x)))
        x = m.maxpool(x)
        taps = []
        for stage in self._stages()[: self.adapt[0] - 1]:
            x = stage(x)
            taps.append(x.mean(dim=(2, 3)))
        return x, taps

    def suffix(self, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        taps = []
        for stage in self._stages()[self.adapt[0] - 1 :]:
            h = stage(h)
            taps.append(h.mean(dim=(2, 3)))
        return self.model.forward_head(h), taps

    def feature_names(self) -> list[str]:
        return [f"layer{i}.gap" for i in range(1, 5)]

    def prefix_description(self) -> str:
        first = self.adapt[0]
        return "stem" + (f" + layer1-{first - 1}" if first > 1 else "")

