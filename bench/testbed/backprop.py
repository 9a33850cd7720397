"""Backprop test-time adaptation baselines in torch (comparators, not product): TENT, SAR, DeYO,
each on the same source model as the ONNX file, following the authors' code.

* TENT (Wang et al. 2021): entropy minimisation over all norm affines, SGD with momentum 0.9.
* SAR (Niu et al. 2023): entropy filter E < 0.4 ln C, sharpness-aware step (SAM, rho 0.05),
  model recovery when the EMA of the loss falls below 0.2.
* DeYO (Lee et al. 2024): entropy filter E < 0.5 ln C, PLPD filter (> 0.2) with a patch-shuffled
  view (4x4 patches), loss re-weighted by exp(-(E - 0.4 ln C)) + exp(PLPD).

SAR and DeYO adapt the norms the ONNX model adapts (its theta layout), TENT every norm affine.
Learning rates are quoted at batch 64 (default: the paper's, 0.001 ViT, 0.00025 ResNet-GN; a
model file's ``tuned`` value when it has one) and scaled as the authors' code scales them:
linearly with the batch size, and for SAR and DeYO doubled below a batch of 32.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eva0_edge.runtime.metadata import ModelMetadata
from eva0_edge.runtime.registry import method_names

from .bnstats import BN_METHODS

SHIPPED_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
BACKPROP_METHODS = tuple(m for m in method_names("torch") if m not in BN_METHODS)
PAPER_LR = {"vit": 1e-3, "resnet_gn": 2.5e-4}


def load_torch_source(
    metadata: ModelMetadata, checkpoint: str | os.PathLike | None = None
) -> nn.Module:
    """The torch source model of an adaptable ONNX file: a testbed architecture with its shipped
    (or given) state dict, or a timm architecture with a local checkpoint."""
    from .testbed_archs import ARCHS

    arch = metadata.architecture
    if arch in ARCHS:
        path = Path(checkpoint) if checkpoint else SHIPPED_MODELS_DIR / f"{arch}.pth"
        if not path.is_file():
            raise FileNotFoundError(f"torch checkpoint for {arch} not found: {path}")
        model = ARCHS[arch]()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    else:
        if checkpoint is None:
            raise ValueError(
                f"backprop baselines need the torch weights of {arch}: pass --torch-checkpoint"
            )
        import timm

        model = timm.create_model(
            arch, checkpoint_path=str(checkpoint), num_classes=metadata.num_classes
        )
    theta = np.concatenate([
        model.state_dict()[s.name].detach().reshape(-1).numpy() for s in metadata.theta_layout
    ])
    if not np.allclose(theta, metadata.theta0, atol=1e-6):
        raise ValueError("torch weights do not match the ONNX model's theta0")
    return model.eval()


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def _norm_params(model: nn.Module, names: set[str] | None) -> list[nn.Parameter]:
    """Affine parameters of norm layers (all, or those whose names are in ``names``)."""
    params = []
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d)):
            for pname, p in module.named_parameters(recurse=False):
                full = f"{module_name}.{pname}"
                if names is None or full in names:
                    params.append(p)
    return params


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation around a base SGD (Foret et al.; SAR's implementation)."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad.norm(p=2) for g in self.param_groups for p in g["params"]
                 if p.grad is not None]
        grad_norm = torch.norm(torch.stack(grads), p=2) if grads else torch.tensor(0.0)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


def _patch_shuffle(x: torch.Tensor, grid: int = 4) -> torch.Tensor:
    """DeYO's object-destroying view: cut into grid x grid patches and shuffle them."""
    n, c, h, w = x.shape
    ph, pw = h // grid, w // grid
    patches = x[:, :, : ph * grid, : pw * grid].unfold(2, ph, ph).unfold(3, pw, pw)
    patches = patches.reshape(n, c, grid * grid, ph, pw)
    perm = torch.stack([torch.randperm(grid * grid) for _ in range(n)])
    patches = patches[torch.arange(n)[:, None], :, perm].permute(0, 2, 1, 3, 4)
    patches = patches.reshape(n, c, grid, grid, ph, pw).permute(0, 1, 2, 4, 3, 5)
    out = x.clone()
    out[:, :, : ph * grid, : pw * grid] = patches.reshape(n, c, ph * grid, pw * grid)
    return out


class BackpropTTA:
    """One of TENT / SAR / DeYO over a torch model; ``step(x)`` returns logits [B, K] (numpy)
    of the forward that precedes the update, as the authors' code does."""

    def __init__(
        self,
        method: str,
        model: nn.Module,
        metadata: ModelMetadata,
        lr: float | None = None,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        if method not in BACKPROP_METHODS:
            raise ValueError(f"unknown backprop method {method!r}: {BACKPROP_METHODS}")
        self.name = method
        self.model = model
        self.num_classes = metadata.num_classes
        base_lr = lr if lr is not None else PAPER_LR.get(metadata.family, 1e-3)
        small_batch_boost = 2.0 if method != "tent" and batch_size < 32 else 1.0
        self.lr = base_lr * batch_size / 64 * small_batch_boost
        self.adapted = None if method == "tent" else {s.name for s in metadata.theta_layout}
        self.seed = seed
        self.source_state = copy.deepcopy(model.state_dict())
        self.reset()

    def reset(self) -> None:
        torch.manual_seed(self.seed)
        self.model.load_state_dict(self.source_state)
        self.model.eval()  # norms here have no running statistics; dropout stays off
        for p in self.model.parameters():
            p.requires_grad_(False)
        params = _norm_params(self.model, self.adapted)
        for p in params:
            p.requires_grad_(True)
        if self.name == "sar":
            self.optimizer = _SAM(params, torch.optim.SGD, lr=self.lr, momentum=0.9)
        else:
            self.optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        self.ema: float | None = None
        self.steps = 0

    def step(self, x: np.ndarray) -> np.ndarray:
        inputs = torch.from_numpy(np.ascontiguousarray(x))
        with torch.enable_grad():
            logits = getattr(self, f"_{self.name}")(inputs)
        self.steps += 1
        return logits.detach().numpy()

    def _tent(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        loss = softmax_entropy(logits).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return logits

    def _sar(self, x: torch.Tensor) -> torch.Tensor:
        margin = 0.4 * math.log(self.num_classes)
        logits = self.model(x)
        entropy = softmax_entropy(logits)
        keep = entropy < margin
        if keep.any():
            entropy[keep].mean().backward()
            self.optimizer.first_step()
            entropy2 = softmax_entropy(self.model(x))[keep]
            keep2 = entropy2 < margin
            if keep2.any():
                loss2 = entropy2[keep2].mean()
                value = loss2.item()
                self.ema = value if self.ema is None else 0.9 * self.ema + 0.1 * value
                loss2.backward()
            self.optimizer.second_step()
            if self.ema is not None and self.ema < 0.2:
                self.reset()
        return logits

    def _deyo(self, x: torch.Tensor) -> torch.Tensor:
        log_c = math.log(self.num_classes)
        logits = self.model(x)
        entropy = softmax_entropy(logits)
        keep = entropy < 0.5 * log_c
        if keep.any():
            with torch.no_grad():
                prime = self.model(_patch_shuffle(x[keep])).softmax(1)
            probs = logits[keep].softmax(1)
            cls = probs.argmax(1, keepdim=True)
            plpd = (probs.gather(1, cls) - prime.gather(1, cls)).reshape(-1)
            keep2 = plpd > 0.2
            if keep2.any():
                ent = entropy[keep][keep2]
                pl = plpd[keep2].detach()
                coeff = torch.exp(-(ent.detach() - 0.4 * log_c)) + torch.exp(pl)
                loss = (ent * coeff).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
        return logits
