"""Black-box prompt mode: a frozen ViT whose only adaptable input is T prompt tokens.

``forward(pixel_values [N, C, H, W], prompt [R, T, D], head_shift [1, D])`` returns
``(logits [R, K], features [R, F], shifted_logits [R, K])`` with R = r * N: the patch embedding
runs once per image and is tiled r times copy-major; the prompts enter after the class token (as
in VPT and FOA); every weight is a constant of the graph. ``features`` are the CLS token after
every block and the classifier head's input; ``shifted_logits`` are the head applied to its input
plus ``head_shift`` (FOA's activation shifting, one cheap extra matmul).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .adaptable import tile_rows


def supports_prompts(model: nn.Module) -> bool:
    """Prompt mode needs a timm VisionTransformer with a class token."""
    from timm.models.vision_transformer import VisionTransformer

    return isinstance(model, VisionTransformer) and bool(getattr(model, "has_class_token", False))


def initial_prompt(model: nn.Module, tokens: int, seed: int) -> torch.Tensor:
    """[T, D] prompts drawn as VPT/FOA initialise them: uniform(-v, v) with
    v = sqrt(6 / (3 * patch_h * patch_w + D)) (Xavier uniform over a patch's fan-in)."""
    dim = model.embed_dim
    patch = model.patch_embed.patch_size
    bound = math.sqrt(6.0 / (3 * patch[0] * patch[1] + dim))
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(tokens, dim, generator=generator) * 2 - 1) * bound


class PromptModel(nn.Module):
    """The graph of a prompt-mode export (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not supports_prompts(model):
            raise ValueError(
                f"prompt mode needs a timm VisionTransformer with a class token, "
                f"not {type(model).__name__}"
            )
        self.model = model

    def forward(
        self, pixel_values: torch.Tensor, prompt: torch.Tensor, head_shift: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = self.model
        x = m.patch_drop(m._pos_embed(m.patch_embed(pixel_values)))
        x = tile_rows(x, prompt.shape[0] // pixel_values.shape[0])
        prefix = m.num_prefix_tokens
        x = m.norm_pre(torch.cat([x[:, :prefix], prompt, x[:, prefix:]], dim=1))
        taps = []
        for block in m.blocks:
            x = block(x)
            taps.append(x[:, 0])
        head_input = m.forward_head(m.norm(x), pre_logits=True)
        features = torch.cat([*taps, head_input], dim=1)
        return m.head(head_input), features, m.head(head_input + head_shift)

    def feature_names(self) -> list[str]:
        return [f"blocks.{i}.out_cls" for i in range(len(self.model.blocks))] + ["head_input"]

    def feature_widths(self) -> list[int]:
        dim = self.model.embed_dim
        return [dim] * len(self.model.blocks) + [self.model.num_features]
