"""Reference outputs straight from timm (torch), sample by sample, for equivalence tests."""

from __future__ import annotations

import numpy as np
import timm
import torch

from eva0_edge.runtime.metadata import ModelMetadata


def load_timm(arch: str, kwargs: dict, checkpoint) -> torch.nn.Module:
    return timm.create_model(arch, checkpoint_path=str(checkpoint), **kwargs).eval()


def _taps(model: torch.nn.Module, family: str) -> tuple[list[torch.nn.Module], callable]:
    if family == "vit":
        cls = (lambda t: t[:, 0]) if model.has_class_token else (lambda t: t.mean(1))
        return list(model.blocks), cls
    return [model.layer1, model.layer2, model.layer3, model.layer4], lambda t: t.mean((2, 3))


@torch.no_grad()
def timm_outputs(
    model: torch.nn.Module, metadata: ModelMetadata, x: np.ndarray, theta: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Run each sample i alone with its adapted tensors set from theta[i].

    x: [N, C, H, W]; theta: [N, P]. Returns logits [N, K] and features [N, F].
    """
    modules, reduce = _taps(model, metadata.family)
    captured: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: captured.append(reduce(out)))
             for m in modules]
    params = dict(model.named_parameters())
    original = {s.name: params[s.name].detach().clone() for s in metadata.theta_layout}
    logits, features = [], []
    try:
        for xi, ti in zip(x, theta, strict=True):
            for seg in metadata.theta_layout:
                chunk = ti[seg.offset : seg.offset + seg.size].reshape(seg.shape)
                params[seg.name].copy_(torch.from_numpy(chunk))
            captured.clear()
            logits.append(model(torch.from_numpy(xi[None])).numpy()[0])
            features.append(torch.cat(captured, dim=1).numpy()[0])
    finally:
        for h in hooks:
            h.remove()
        for name, value in original.items():
            params[name].copy_(value)
    return np.stack(logits), np.stack(features)
