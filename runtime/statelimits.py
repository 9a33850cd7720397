"""How far a state may be from the model it is installed on.

:mod:`.state` checks that every value of a state is well-formed (types, finiteness, ranges that
hold for any model). A state can be well-formed and still be one the model cannot survive: a
theta of 1e30 serves one class for everything, a paused count of 2^62 switches adaptation off
for good, a test mean far from the source's makes the activation shift's offset swamp the
logits. Anyone with the admin token can re-sign such a state, so every state is also held to
what adaptation itself could have produced on this model:

* theta, anchor and the healthy checkpoint within ``theta_radius`` of theta0: an RMS change of
  1 per adapted parameter (norm scales and shifts live on the order of 1), or the guard's drift
  bound where that is larger; the momentum ``velocity`` no longer than one step at the
  method's eta could take across that radius;
* ``pause_left`` at most the guard's longest pause (``max(guard_pause, guard_warmup)``) plus
  one batch of :data:`MAX_PAUSE_BATCH` samples;
* the activation shift's windows: their means within ``shift_radius`` of the source head mean
  (10x the head input's scale ``max(||m_source||, sqrt(D))``; not ``shift_max``, which a
  window may pass before it holds enough samples to be checked), their mean squared norms at
  most (10x that scale)^2 and at least the squared norm of their mean (they are moments of the
  same samples);
* the domain bank (:mod:`.bank`): at most ``bank_slots`` slots, each theta within
  ``theta_radius`` of theta0 and each shift mean within ``shift_radius`` of the source's, as
  the state's own (:func:`~.bank.check_bank`);
* the feature moments: total energy ``sum(second_moment)`` at most 100x the source's
  ``sum(mean^2 + std^2)`` (an RMS feature norm 10x the source's), where the file has source
  statistics; each feature's second moment at least its mean squared (windowed means of h and
  h^2 over the same samples);
* ``anchor_credit`` below 1 (+1e-6): the anchor share keeps only the fraction of a row it has
  not yet handed out (a credit of 1e300 made every row anchor-guided);
* ``balance_in`` / ``balance_out`` at most ``theta_radius``: running means of an update's
  component along the anchor direction, which no update that keeps theta in its radius
  exceeds;
* the output centre ``center`` (and each bank slot's), where the head is known (the activation
  shift is on): a windowed mean of the model's logits, so ``W h_bar + b`` for h_bar the mean
  head input of its window, held to the head inputs' own bound: within ``||W||_2 x
  shift_radius`` of the source's ``W m_source + b`` (the shipped models' hostile streams,
  black, white and noise frames, reach at most 6.4% of that, the ViT's). An empty centre
  (``stat_weight`` 0, the state's or a slot's) is not checked.

``coef_scale`` (the running scale of the per-sample coefficients, :mod:`.stepcontrol`) has no
bound: the alignment term of the objective has no upper bound, so any bound could refuse a state
a server wrote. What a forged one can do is bounded all the same: it lifts the coefficients'
clipping, and every step is still held to the trust radius and theta to its radius, under the
guard's watch.

Every bound is many times what the shipped models reach on the severity-5 streams
(``tests/component/test_state_validation.py`` walks adapted states through them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from .bank import KEY_WIDTH, SCALARS, bank_sizes, check_bank
from .state import AdaptState, StateError, check_state_sizes

if TYPE_CHECKING:
    from .config import AdaptConfig
    from .metadata import ModelMetadata
    from .shift import ActivationShift

MAX_PAUSE_BATCH = 2**16  # the largest batch whose pause a state may carry
SCALE_MARGIN = 10.0  # the activation and feature bounds: 10x the source's scale


@dataclass(frozen=True)
class StateLimits:
    """The bounds of one model and method. theta0: [P]; shift_source: the source head mean
    [D] (None: no shift); feature_energy: the bound on ``sum(second_moment)`` (None: no source
    statistics); sizes: the elements of every state array (None: not checked here);
    shift_width: the head input's width D the shift windows hold (None: no shift); bank_slots:
    the domain bank's slots (``bank_slots``); center_source: the source's logits ``W m_source
    + b`` [K] and center_radius the farthest an output centre may be from them (None and
    inf: no head known)."""

    theta0: np.ndarray
    theta_radius: float
    eta: float
    max_pause: int
    shift_source: np.ndarray | None = None
    shift_radius: float = np.inf
    shift_square_max: float = np.inf
    feature_energy: float | None = None
    sizes: dict[str, int] | None = None
    shift_width: int | None = None
    bank_slots: int = 0
    center_source: np.ndarray | None = None
    center_radius: float = np.inf

    def check(self, state: AdaptState) -> None:
        """StateError naming the first field of the wrong size or beyond its bound (sizes
        first, then magnitudes); nothing else happens."""
        if self.sizes is not None:
            check_state_sizes(state, self.sizes)
        for name in ("shift_mean", "shift_recent"):
            size = getattr(state, name).size
            if self.shift_width is not None and size not in (0, self.shift_width):
                raise StateError(f"this state is for another model: state {name} has {size} "
                                 f"values, this model's head input {self.shift_width}")
        for name in ("shift_classes", "shift_recent_classes", "shift_prior"):
            size = getattr(state, name).size
            if size not in (0, state.center.size):
                raise StateError(f"this state is for another model: state {name} has {size} "
                                 f"values, this model has {state.center.size} classes")
        theta0 = self.theta0.astype(np.float64)
        for name in ("theta", "anchor", "healthy_theta"):
            distance = float(np.linalg.norm(getattr(state, name) - theta0))
            if distance > self.theta_radius:
                raise StateError(
                    f"state {name} is {distance:.4g} from theta0; this model allows at most "
                    f"{self.theta_radius:.4g}"
                )
        reach = self.eta * float(np.linalg.norm(state.velocity.astype(np.float64)))
        if reach > self.theta_radius:
            raise StateError(
                f"state velocity would move theta {reach:.4g} in one step (eta x ||velocity||); "
                f"this model allows at most {self.theta_radius:.4g} from theta0"
            )
        if state.pause_left > self.max_pause:
            raise StateError(
                f"state pause_left = {state.pause_left} exceeds the longest pause this model's "
                f"guard takes ({self.max_pause} samples)"
            )
        self._check_shift(state)
        check_bank(state, self.bank_slots, self.theta0, self.theta_radius, self.shift_width or 0,
                   state.center.size, self.shift_source, self.shift_radius)
        self._check_centers(state)
        if state.anchor_credit >= 1.0 + 1e-6:
            raise StateError(f"state anchor_credit = {state.anchor_credit:.4g} is not below 1 "
                             "(the part of an anchor-guided row not yet handed out)")
        for name in ("balance_in", "balance_out"):
            value = getattr(state, name)
            if value > self.theta_radius:
                raise StateError(f"state {name} = {value:.4g} is over {self.theta_radius:.4g}, "
                                 "the farthest an update may move theta")
        mean, second = state.mean.astype(np.float64), state.second_moment.astype(np.float64)
        gap = second - mean * mean
        if mean.size == second.size and (gap < -1e-6 * (second + mean * mean) - 1e-12).any():
            worst = int(np.argmin(gap))
            raise StateError(f"state second_moment[{worst}] = {second[worst]:.4g} is below "
                             f"mean[{worst}]^2 = {mean[worst] ** 2:.4g}: not moments of one set "
                             "of samples")
        if self.feature_energy is not None:
            energy = float(state.second_moment.sum())
            if energy > self.feature_energy:
                raise StateError(
                    f"state second_moment sums to {energy:.4g}, over {self.feature_energy:.4g} "
                    "(100x the source features' energy)"
                )

    def _check_centers(self, state: AdaptState) -> None:
        """StateError when the output centre, or a bank slot's, is farther than
        ``center_radius`` from the source's logits (an empty centre is not checked)."""
        if self.center_source is None:
            return
        classes = self.center_source.size
        centers = {"center": state.center.astype(np.float64)} if state.stat_weight > 0 else {}
        count = state.bank_keys.size // KEY_WIDTH
        if count:
            rows = state.bank_moments.reshape(count, -1)[:, :classes].astype(np.float64)
            weights = state.bank_scalars.reshape(count, len(SCALARS))[:, SCALARS.index(
                "stat_weight")]
            centers.update({f"bank_moments (slot {i}'s center)": row
                            for i, row in enumerate(rows) if weights[i] > 0})
        for name, center in centers.items():
            distance = float(np.linalg.norm(center - self.center_source))
            if distance > self.center_radius:
                raise StateError(
                    f"state {name} is {distance:.4g} from the source's logits; this model's "
                    f"head reaches at most {self.center_radius:.4g} (||W||_2 x the head "
                    "inputs' bound)")

    def _check_shift(self, state: AdaptState) -> None:
        windows = (("shift_mean", "shift_sq"), ("shift_recent", "shift_recent_sq"))
        for mean_name, square_name in windows:
            mean, square = getattr(state, mean_name), getattr(state, square_name)
            if mean.size and self.shift_source is not None:
                distance = float(np.linalg.norm(mean - self.shift_source))
                if distance > self.shift_radius:
                    raise StateError(
                        f"state {mean_name} is {distance:.4g} from the source head mean; this "
                        f"model allows at most {self.shift_radius:.4g}"
                    )
            if square > self.shift_square_max:
                raise StateError(
                    f"state {square_name} = {square:.4g} is over {self.shift_square_max:.4g} "
                    "(the head input's squared scale, x100)"
                )
            if not mean.size:
                continue
            norm2 = float(mean @ mean)
            if square < norm2 * (1.0 - 1e-9) - 1e-12:
                raise StateError(
                    f"state {square_name} = {square:.4g} is below the squared norm of "
                    f"{mean_name} ({norm2:.4g}): not moments of one set of samples"
                )


def state_limits(
    config: AdaptConfig, metadata: ModelMetadata,
    source_stats: tuple[np.ndarray, np.ndarray] | None, shift: ActivationShift | None,
) -> StateLimits:
    """How far an installed state may be from the model of ``metadata`` under ``config``
    (``source_stats``: the source feature mean and std [F], or None; ``shift``: the activation
    shift, or None)."""
    theta_radius = max(float(np.sqrt(metadata.num_params)), config.guard_drift_max or 0.0)
    limits = StateLimits(
        metadata.theta0.astype(np.float32), theta_radius, config.eta,
        max(config.guard_pause, config.guard_warmup) + MAX_PAUSE_BATCH,
        sizes=state_sizes(metadata), shift_width=None if shift is None else shift.head.width,
        bank_slots=getattr(config, "bank_slots", 0),
    )
    if source_stats is not None:
        mean, std = source_stats
        energy = float((mean**2 + std**2).sum())
        limits = replace(limits, feature_energy=SCALE_MARGIN**2 * energy)
    if shift is not None:
        source = shift.source_mean
        scale = SCALE_MARGIN * max(float(np.linalg.norm(source)), float(np.sqrt(source.size)))
        weight = shift.head.weight.astype(np.float64)
        limits = replace(limits, shift_source=source, shift_square_max=scale**2,
                         shift_radius=scale,
                         center_source=weight @ source + shift.head.bias.astype(np.float64),
                         center_radius=float(np.linalg.norm(weight, 2)) * scale)
    return limits


def state_sizes(metadata: ModelMetadata) -> dict[str, int]:
    """Elements of every state array for the model of ``metadata``."""
    md = metadata
    return {
        "theta": md.num_params, "anchor": md.num_params, "velocity": md.num_params,
        "healthy_theta": md.num_params,
        "center": md.num_classes, "mean": md.num_features, "second_moment": md.num_features,
        "shift_mean": md.num_features,  # at most: the head input is one feature segment
        "shift_recent": md.num_features,
        "shift_classes": md.num_classes, "shift_recent_classes": md.num_classes,
        "shift_prior": md.num_classes,
        **bank_sizes(md.num_params, md.num_features, md.num_classes),
    }
