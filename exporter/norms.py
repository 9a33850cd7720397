"""Norm layers whose affine parameters come per row from the ``theta`` graph input.

Each adapted LayerNorm / GroupNorm is replaced by a module that normalises without affine and
then multiplies/adds the slice of ``theta`` [R, P] that holds its weight and bias, so that every
row R of the batch runs with its own parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ThetaSource:
    """Holds the ``theta`` tensor of the forward pass in progress ([R, P] float32).

    The adaptable wrapper sets it at the top of ``forward``; the per-sample norms read their slice.
    """

    def __init__(self) -> None:
        self.theta: torch.Tensor | None = None

    def slice(self, offset: int, size: int) -> torch.Tensor:
        if self.theta is None:
            raise RuntimeError("per-sample norm called outside the adaptable forward")
        return self.theta[:, offset : offset + size]


def group_norm_no_affine(x: torch.Tensor, num_groups: int, eps: float) -> torch.Tensor:
    """GroupNorm without affine, lowered to Reshape + LayerNormalization + Reshape.

    ORT CPU runs LayerNormalization as one fused kernel and no ones/zeros affine is left in the
    graph. At ResNet50-GN's four stage shapes (batch 8) it took 0.66-0.92x the time of
    GroupNormalization (opset 18) and was on par with the InstanceNormalization lowering (faster
    at 2 of 4 shapes): ``python studies/gn-lowering/gn_lowering.py``. x: [N, C, *spatial].
    """
    shape = x.shape
    grouped = x.reshape(shape[0], num_groups, -1)
    normed = F.layer_norm(grouped, grouped.shape[-1:], None, None, eps)
    return normed.reshape(shape)


class FastGroupNorm(nn.Module):
    """A frozen GroupNorm with its own (shared) affine, lowered for ORT CPU speed."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.num_groups = norm.num_groups
        self.eps = norm.eps
        self.weight = nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = group_norm_no_affine(x, self.num_groups, self.eps)
        return y * self.weight[:, None, None] + self.bias[:, None, None]


class PerSampleGroupNorm(nn.Module):
    """GroupNorm whose weight/bias are theta[:, w_off:w_off+C] and theta[:, b_off:b_off+C]."""

    def __init__(self, norm: nn.GroupNorm, source: ThetaSource, w_offset: int, b_offset: int):
        super().__init__()
        self.num_groups = norm.num_groups
        self.num_channels = norm.num_channels
        self.eps = norm.eps
        self.source = source
        self.w_offset = w_offset
        self.b_offset = b_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = group_norm_no_affine(x, self.num_groups, self.eps)
        c = self.num_channels
        w = self.source.slice(self.w_offset, c)[:, :, None, None]
        b = self.source.slice(self.b_offset, c)[:, :, None, None]
        return y * w + b


class PerSampleLayerNorm(nn.Module):
    """LayerNorm over the last dim D whose weight/bias come from theta; x: [R, ..., D]."""

    def __init__(self, norm: nn.LayerNorm, source: ThetaSource, w_offset: int, b_offset: int):
        super().__init__()
        if len(norm.normalized_shape) != 1:
            raise ValueError("only LayerNorm over the last dimension can be adapted")
        self.dim = norm.normalized_shape[0]
        self.eps = norm.eps
        self.source = source
        self.w_offset = w_offset
        self.b_offset = b_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, (self.dim,), None, None, self.eps)
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.dim,)
        w = self.source.slice(self.w_offset, self.dim).reshape(view)
        b = self.source.slice(self.b_offset, self.dim).reshape(view)
        return y * w + b
