"""Hyper-parameters of the adaptation methods, with the paper's defaults.

Precedence, lowest first: these defaults, the model file's ``recommended`` values, the user's
overrides. Every EVA-0 component is a switch so the paper's ablations can be rerun.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class AdaptConfig:
    """EVA-0 and its forward-only relatives. Units: all rates are per step (one batch).

    mu: SPSA perturbation radius. eta: SGD step size. anchor_per_64: anchor-guided rows per 64
    samples (k), accumulated across steps so B = 1 keeps the share. gamma: relaxation weight
    toward the anchor. rho: weight of the history in the sample-wise moments (the sample moves
    them by 1 - rho). lambda_swa: weight of l_SWA (0 = EVA-0-dagger). alpha: EMA factor of the
    output centre and target moments (weight of the old value). momentum: SGD momentum.
    balance_beta: EMA factor of the inward/outward magnitudes (None = balancing off).
    moving_anchor: m_a of theta_anc <- m_a theta + (1 - m_a) theta_anc (None = fixed anchor).
    forwards: forward passes per sample (#FP), even: q = forwards / 2 two-sided perturbation
    pairs per sample in one ORT call, their estimates and their 2q outputs averaged (the paper's
    black-box study); one-sided methods take exactly 2.
    """

    mu: float = 0.06
    eta: float = 0.002
    anchor_per_64: float = 1.0
    gamma: float = 0.001
    rho: float = 0.999
    lambda_swa: float = 500.0
    alpha: float = 0.9
    momentum: float = 0.0
    shortcut_resistant: bool = True
    center: bool = True
    sample_wise: bool = True
    two_sided: bool = True
    balance_beta: float | None = None
    moving_anchor: float | None = None
    regenerate_z: bool = False
    forwards: int = 2
    eps: float = 1e-8
    delta: float = 1e-8

    def updated(self, values: dict[str, Any]) -> AdaptConfig:
        """A copy with ``values`` applied; ValueError naming any unknown key."""
        return replaced(self, values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replaced(config: Any, values: dict[str, Any]) -> Any:
    """A copy of the frozen dataclass ``config`` with ``values`` applied; ValueError naming any
    key it does not have."""
    known = {f.name for f in fields(config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown hyper-parameter(s) {unknown}; known: {sorted(known)}")
    return replace(config, **values)


_FAMILY_RECOMMENDED: dict[str, dict[str, Any]] = {
    "vit": {"lambda_swa": 500.0, "alpha": 0.9},
    "resnet_gn": {"lambda_swa": 50.0, "alpha": 0.0},
}


def recommended_for_family(family: str) -> dict[str, Any]:
    """The paper's per-architecture values (ViT-Base / ResNet50-GN), written at export."""
    return dict(_FAMILY_RECOMMENDED.get(family, {}))


def parse_key_values(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``["eta=0.001", "layers=[1,1,1,1]", "norm_layer=groupnorm"]``: values are Python
    literals where they parse as one, else strings."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad setting {item!r}: use KEY=VALUE, e.g. eta=0.001")
        try:
            values[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            values[key.strip()] = value
    return values
