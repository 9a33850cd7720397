"""The BatchNorm-statistics baselines (bn-adapt, bn-ema): what each normalises with."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from eva0_edge.bench.testbed.bnstats import BatchNormStats


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2)
        model[1].weight.uniform_(0.5, 1.5)
    return model.eval()


def _batch(n: int = 8, shift: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((n, 3, 8, 8)) + shift).astype(np.float32)


def _train_mode_logits(model: nn.Module, x: np.ndarray) -> np.ndarray:
    probe = copy.deepcopy(model).train()
    with torch.no_grad():
        return probe(torch.from_numpy(x)).numpy()


def test_bn_adapt_mixes_source_and_batch_statistics():
    model, x = _model(), _batch()
    with torch.no_grad():
        source = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(BatchNormStats("bn-adapt", model, {"bn_prior": 0}).step(x),
                               _train_mode_logits(model, x), atol=1e-5)
    np.testing.assert_allclose(BatchNormStats("bn-adapt", model, {"bn_prior": 1e9}).step(x),
                               source, atol=1e-4)
    mixed = BatchNormStats("bn-adapt", model, {"bn_prior": 8}).step(x)
    assert not np.allclose(mixed, source, atol=1e-3)
    # nothing is kept: the same batch twice gives the same logits
    method = BatchNormStats("bn-adapt", model)
    np.testing.assert_array_equal(method.step(x), method.step(x))


def test_bn_ema_moves_the_running_statistics_and_keeps_them():
    model, x = _model(), _batch()
    full = BatchNormStats("bn-ema", model, {"bn_momentum": 1.0})
    np.testing.assert_allclose(full.step(x), _train_mode_logits(model, x), atol=1e-5)
    slow = BatchNormStats("bn-ema", model, {"bn_momentum": 0.1})
    first, second = slow.step(x), slow.step(x)
    assert not np.allclose(first, second, atol=1e-4)  # the state moved
    slow.reset()
    np.testing.assert_allclose(slow.step(x), first, atol=1e-6)
    assert model[1].running_mean.abs().sum() > 0 and torch.equal(
        model[1].running_mean, _model()[1].running_mean)  # the source is left alone


def test_timm_batchnorm_act_keeps_its_activation():
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4, act_layer=nn.ReLU),
                          nn.Flatten()).eval()
    out = BatchNormStats("bn-adapt", model, {"bn_prior": 0}).step(_batch(shift=0.0))
    assert (out >= 0).all() and (out == 0).any()


def test_bad_knobs_and_models_are_refused():
    with pytest.raises(ValueError, match="bn_momentum"):
        BatchNormStats("bn-ema", _model(), {"bn_momentum": 0})
    with pytest.raises(ValueError, match="has none"):
        BatchNormStats("bn-adapt", nn.Sequential(nn.Flatten(), nn.Linear(3, 2)))
