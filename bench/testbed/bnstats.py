"""BatchNorm-statistics baselines in torch (comparators, not product): the one-forward
adaptation a BatchNorm user tries first. No gradient, no loss: every BatchNorm layer normalises
with statistics that include the test batch.

* ``bn-adapt`` (Schneider et al. 2020, "Improving robustness against common corruptions by
  covariate shift adaptation"): the source statistics and the test batch's, weighted by a prior
  N (source) against the batch size n: mean = (N mean_s + n mean_b) / (N + n), the same for the
  variance. Nothing is kept between batches; at B = 1 the batch's statistics are one image's.
* ``bn-ema`` (the running-statistics update DUA builds on, Mirza et al. 2022): every batch moves
  the running statistics by ``momentum`` towards its own, layer by layer inside the forward,
  and the layer normalises with the updated ones; kept across batches (the stream's state).

The knobs (``bn_prior``, ``bn_momentum``) are tuned on the validation split like every other
method's rates (``models/recipes/tune.py --method bn-ema --grid bn_momentum=...``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BN_METHODS = ("bn-adapt", "bn-ema")
DEFAULTS = {"bn-adapt": {"bn_prior": 16.0}, "bn-ema": {"bn_momentum": 0.01}}


class _TestStatsBatchNorm(nn.Module):
    """A frozen BatchNorm2d whose statistics include the test batch (see the module doc)."""

    def __init__(self, norm: nn.BatchNorm2d, method: str, knob: float) -> None:
        super().__init__()
        self.method, self.knob, self.eps = method, knob, norm.eps
        self.weight = nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach().clone(), requires_grad=False)
        self.register_buffer("source_mean", norm.running_mean.detach().clone())
        self.register_buffer("source_var", norm.running_var.detach().clone())
        self.register_buffer("running_mean", norm.running_mean.detach().clone())
        self.register_buffer("running_var", norm.running_var.detach().clone())
        # timm's BatchNormAct2d applies its dropout and activation after normalising
        self.after = nn.Sequential(getattr(norm, "drop", nn.Identity()),
                                   getattr(norm, "act", nn.Identity()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        if self.method == "bn-adapt":
            n, prior = float(x.shape[0]), self.knob
            mean = (prior * self.source_mean + n * mean) / (prior + n)
            var = (prior * self.source_var + n * var) / (prior + n)
        else:
            self.running_mean.mul_(1 - self.knob).add_(self.knob * mean)
            self.running_var.mul_(1 - self.knob).add_(self.knob * var)
            mean, var = self.running_mean, self.running_var
        return self.after(F.batch_norm(x, mean, var, self.weight, self.bias, False, 0.0,
                                       self.eps))


class BatchNormStats:
    """``bn-adapt`` or ``bn-ema`` over a torch model with BatchNorm2d layers; ``step(x)``
    returns the logits [B, K] (numpy) of its one forward."""

    def __init__(self, method: str, model: nn.Module, knobs: dict | None = None) -> None:
        if method not in BN_METHODS:
            raise ValueError(f"unknown BatchNorm-statistics method {method!r}: {BN_METHODS}")
        values = {**DEFAULTS[method], **(knobs or {})}
        knob = float(values["bn_prior"] if method == "bn-adapt" else values["bn_momentum"])
        if (method == "bn-adapt" and knob < 0) or (method == "bn-ema" and not 0 < knob <= 1):
            raise ValueError(f"{method}: need bn_prior >= 0 / 0 < bn_momentum <= 1, got {knob}")
        self.name = method
        self.source = copy.deepcopy(model).eval()
        self.method, self.knob = method, knob
        norms = [n for n, m in self.source.named_modules() if isinstance(m, nn.BatchNorm2d)]
        if not norms:
            raise ValueError(f"{method} needs BatchNorm layers; the model has none")
        self.reset()

    def reset(self) -> None:
        self.model = copy.deepcopy(self.source)
        for name, module in list(self.model.named_modules()):
            if isinstance(module, nn.BatchNorm2d):
                parent_name, _, child = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                setattr(parent, child, _TestStatsBatchNorm(module, self.method, self.knob))
        self.steps = 0

    @torch.no_grad()
    def step(self, x: np.ndarray) -> np.ndarray:
        logits = self.model(torch.from_numpy(np.ascontiguousarray(x)))
        self.steps += 1
        return logits.numpy()
