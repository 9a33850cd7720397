"""The torch module that becomes the adaptable ONNX graph.

``forward(pixel_values [N, C, H, W], theta [R, P]) -> (logits [R, K], features [R, F])`` with
R = r * N: the prefix runs once per image, its output is tiled r times copy-major (rows
``j*N .. j*N+N-1`` are all N images under theta rows of copy j), and the suffix runs per row.
"""

from __future__ import annotations

import torch
from torch import nn

from .families import Family


def tile_rows(x: torch.Tensor, copies: torch.Tensor | int) -> torch.Tensor:
    """[N, ...] -> [copies * N, ...], copy-major (``torch.cat([x] * copies)``)."""
    return x.unsqueeze(0).expand(copies, *x.shape).reshape(-1, *x.shape[1:])


class AdaptableModel(nn.Module):
    """Wraps a family-split timm model whose adapted norms read their affine from ``theta``."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self.family = family
        self.model = family.model

    def forward(
        self, pixel_values: torch.Tensor, theta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.family.source.theta = theta
        hidden, taps = self.family.prefix(pixel_values)
        copies = theta.shape[0] // pixel_values.shape[0]
        hidden = tile_rows(hidden, copies)
        taps = [tile_rows(t, copies) for t in taps]
        logits, suffix_taps = self.family.suffix(hidden)
        return logits, torch.cat(taps + suffix_taps, dim=1)

    @torch.no_grad()
    def tap_widths(self, pixel_values: torch.Tensor, theta: torch.Tensor) -> list[int]:
        """Width of every feature tap, read off one dry run."""
        self.family.source.theta = theta
        hidden, taps = self.family.prefix(pixel_values)
        _, suffix_taps = self.family.suffix(hidden)
        return [t.shape[1] for t in taps + suffix_taps]
