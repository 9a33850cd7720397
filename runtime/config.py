"""Hyper-parameters of the adaptation methods, with the paper's defaults.

Precedence, lowest first: these defaults, the model file's ``recommended`` values, the user's
overrides. Every EVA-0 component is a switch so the paper's ablations can be rerun.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, get_args, get_type_hints

import numpy as np

from .bank import BANK_THRESHOLD, MAX_BANK_SLOTS
from .budget import BURST_SAMPLES, check_budget

if TYPE_CHECKING:
    from .metadata import ModelMetadata
    from .registry import MethodSpec

# the activation shift's settings, tuned with the method's rates (MethodSpec.shift_from)
SHIFT_KEYS = ("activation_shift", "shift_window", "shift_max")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptConfig:
    """EVA-0 and its forward-only relatives.

    Units: the rates are quoted per *reference batch* of ``reference_batch`` samples (the
    paper's per-step values at B = 64) and converted to the batch actually stepped, so a value
    means the same at B = 1 and at B = 64 (:mod:`rates` states the rules and their reasoning).
    Model files' ``recommended`` values and older state files are read in these units: the
    paper's values were per step at B = 64, which is what a reference batch is.

    mu: SPSA perturbation radius (per perturbation, no conversion). eta: SGD step size per
    reference batch (eta B / 64 per step). anchor_per_64: anchor-guided rows per 64 samples (k),
    accumulated across steps so B = 1 keeps the share. gamma: relaxation toward the anchor per
    reference batch. rho: weight of the history in the sample-wise moments when one sample is
    added (per sample already). lambda_swa: weight of l_SWA (0 = EVA-0-dagger). alpha: EMA
    factor of the output centre and target moments per reference batch, read as a per-sample
    window of W = 64 (1 + alpha) / (1 - alpha) samples unless ``stat_window`` (samples) is set.
    momentum: SGD momentum per reference batch (damped form, see :mod:`rates`). balance_beta:
    EMA factor of the inward/outward magnitudes per reference batch (None = balancing off).
    moving_anchor: m_a of theta_anc <- m_a theta + (1 - m_a) theta_anc per reference batch
    (None = fixed anchor). forwards: forward passes per sample (#FP), even: q = forwards / 2
    two-sided perturbation pairs per sample in one ORT call, their estimates and their 2q
    outputs averaged (the paper's black-box study); one-sided methods take exactly 2.

    Step control (:mod:`stepcontrol`): coef_clip: each per-sample coefficient |c_i| is clipped
    at this multiple of the running mean |c| over the last ``coef_window`` samples (None = no
    clipping). trust_radius: ||delta theta|| <= trust_radius eta sqrt(P B / 64) per step, i.e.
    a root-mean-square change per adapted parameter of at most trust_radius x eta per reference
    batch, with the sqrt(B / 64) rule of noise-dominated steps (None = unbounded).

    Health guard (:mod:`guard`, on with ``guard``): signals over the last ``guard_window``
    samples, checked from ``guard_warmup`` samples on, against the ``guard_*_min`` /
    ``guard_*_max`` bounds (None = unchecked; entropy and spread are fractions of ln K); a
    healthy checkpoint every ``guard_checkpoint`` samples; after a trip, adaptation pauses for
    ``guard_pause`` samples; every ``guard_audit`` adapted samples (None = never) an audit of
    ``guard_warmup`` samples duels the current theta against theta0, which wins when the
    current theta's feature distance to the source is over ``guard_audit_margin`` times its
    own; a change of stream (seen in the input images, :mod:`inputwatch`, or by the
    activation shift) starts such an audit at once when ``guard_change_audit``, serving theta0,
    and there the current theta must be within ``guard_change_margin`` times theta0's distance
    (1: at least as close to the source on the new stream).

    Compute budget (:mod:`budget`): ``budget`` forwards per sample on average (1 <= budget
    <= forwards; None = the method's own: adapt on every batch); a batch not adapted on is
    served at the current theta with one forward, the spending dense after a change of
    stream and sparse once the stream is learnt; ``budget_burst``: the samples whose credit
    the bucket holds (the most a change of stream can spend at once).

    Activation shift (:mod:`shift`, FOA's, at no forward): the served logits are the head
    applied to its input moved by ``activation_shift`` x (source mean - test mean) of the head
    input (0 = off; FOA: 1), the test mean a window of the last ``shift_window`` samples (FOA's
    EMA: 1216); ``shift_max``: the window restarts, unshifted, when ||source mean - test mean||
    exceeds it (None = unbounded). Needs the file's source statistics.
    ``shift_prior_window``: the label-shift correction (a file calibrated with the per-class
    source means, ``head_input_class_means``): the gap to the source is taken at the class mix
    the stream has over its last ``shift_prior_window`` samples rather than at the mix of the
    shift's own window, so a run of one class (a camera watching one object) is not moved off
    that class (None = off: the window's mean against the source mean, as FOA).

    Source-free activation shift (:class:`~.shift.SourceFreeShift`, for a file without source
    statistics: EVA-0-dagger's): ``free_shift`` x the offset that makes the windowed mean logit
    of the last ``shift_window`` samples equal across classes (0 = off), the head's weights and
    the test stream its only inputs; unused while ``activation_shift`` is on.
    ``free_shift_margin``: the root-mean-square class imbalance of that mean logit (nats) taken
    for the model's own: the offset is shrunk by max(0, 1 - margin^2 / rms^2), so a stream with
    about that much imbalance (clean images) is barely moved (0 = no shrinkage).

    Domain memory (:mod:`.bank`): ``bank_slots`` past stream segments' adapted states (theta,
    moments, the shift's window) kept, least recently used evicted (0 = off; at most
    ``MAX_BANK_SLOTS``), keyed by the segment's input descriptors; a new segment within
    ``bank_threshold`` standard errors of a key (the input change detector's test) restores
    that state at no forward and the budget spends on it as on a stream it knows.
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
    reference_batch: int = 64
    stat_window: float | None = None
    coef_clip: float | None = 5.0
    coef_window: float = 256.0
    trust_radius: float | None = 10.0
    guard: bool = False
    guard_window: float = 256.0
    guard_warmup: int = 64
    guard_checkpoint: int = 256
    guard_pause: int = 256
    guard_audit: int | None = None
    guard_audit_margin: float = 2.0
    guard_change_audit: bool = True
    guard_change_margin: float = 1.0
    guard_entropy_min: float | None = 0.02
    guard_entropy_max: float | None = 0.98
    guard_spread_min: float | None = 0.05
    guard_logit_norm_min: float | None = None
    guard_logit_norm_max: float | None = None
    guard_drift_max: float | None = None
    guard_alignment_max: float | None = None
    budget: float | None = None
    budget_burst: int = BURST_SAMPLES
    activation_shift: float = 0.0
    shift_window: float = 1216.0
    shift_max: float | None = None
    shift_prior_window: float | None = 1024.0
    free_shift: float = 0.0
    free_shift_margin: float = 0.0
    bank_slots: int = 0
    bank_threshold: float = BANK_THRESHOLD
    eps: float = 1e-8
    delta: float = 1e-8

    def updated(self, values: dict[str, Any]) -> AdaptConfig:
        """A copy with ``values`` applied; ValueError naming any unknown key."""
        return replaced(self, values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (bool, int, float, each optionally
    ``| None``; an int is a float, a bool is neither); other annotations are not checked."""
    allowed = get_args(hint) or (hint,)
    if not set(allowed) <= {bool, int, float, type(None)}:
        return True
    if value is None or isinstance(value, (bool, np.bool_)):
        return (bool if value is not None else type(None)) in allowed
    return (isinstance(value, Integral) and (int in allowed or float in allowed)) or (
        isinstance(value, Real) and float in allowed
    )


_KINDS = {bool: "a boolean (true/false, yes/no, on/off)", int: "an integer", float: "a number"}


def _coerced(key: str, value: Any, hint: Any) -> Any:
    """``value`` as the field ``key`` of annotated type ``hint`` takes it: as it is when it fits
    (:func:`_fits`), 0 / 1 as a boolean, an integral number (4.0) as an integer; else
    ValueError naming the key and the type it expects (``--set eta=abc``)."""
    if _fits(value, hint):
        return value
    allowed = get_args(hint) or (hint,)
    if not isinstance(value, (bool, np.bool_)) and isinstance(value, Real):
        if bool in allowed and value in (0, 1):
            return bool(value)
        if int in allowed and float(value).is_integer():
            return int(float(value))
    kinds = " or ".join(_KINDS[kind] for kind in (bool, int, float) if kind in allowed)
    if type(None) in allowed:
        kinds += " or none"
    raise ValueError(f"hyper-parameter {key} must be {kinds}, got {value!r:.40}")


def replaced(config: Any, values: dict[str, Any]) -> Any:
    """A copy of the frozen dataclass ``config`` with ``values`` applied, each coerced to its
    field's type (:func:`_coerced`); ValueError naming any key it does not have, or a value not
    of the key's type (``--set eta=abc``)."""
    known = {f.name for f in fields(config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown hyper-parameter(s) {unknown}; known: {sorted(known)}")
    hints = get_type_hints(type(config))
    return replace(config, **{key: _coerced(key, value, hints[key])
                              for key, value in values.items()})


_FAMILY_RECOMMENDED: dict[str, dict[str, Any]] = {
    "vit": {"lambda_swa": 500.0, "alpha": 0.9},
    "resnet_gn": {"lambda_swa": 50.0, "alpha": 0.0},
}


def engine_config(
    spec: MethodSpec, metadata: ModelMetadata, overrides: dict[str, Any]
) -> AdaptConfig:
    """The EVA-0-family method ``spec``'s values on the model of ``metadata``: the defaults,
    then the file's recommended values, the method's overrides, the activation shift tuned for
    the method's ``shift_from`` (when on there), the file's tuned values for the method and the
    caller's ``overrides``, in that order; checked (ValueError naming the
    value). Without source statistics lambda_swa is 0 (source-free, with a warning)."""
    method = spec.name
    config = AdaptConfig().updated(metadata.recommended)
    config = config.updated(spec.overrides)
    shared = metadata.tuned.get(spec.shift_from or "", {})
    if shared.get("activation_shift"):  # the shift as tuned for spec.shift_from's method
        config = config.updated({k: shared[k] for k in SHIFT_KEYS if k in shared})
    config = config.updated(metadata.tuned.get(method, {})).updated(overrides)
    if config.lambda_swa > 0 and not metadata.has_source_stats:
        if spec.adapts:
            log.warning(
                "%s: model has no source statistics; lambda_swa set to 0 (source-free). "
                "Run `eva0-edge calibrate` to add them.",
                method,
            )
        config = config.updated({"lambda_swa": 0.0})
    if config.mu <= 0 or config.eta < 0 or not 0 <= config.gamma <= 1:
        raise ValueError("need mu > 0, eta >= 0 and 0 <= gamma <= 1")
    if not 0 <= config.alpha < 1 or not 0 <= config.momentum < 1:
        raise ValueError("need 0 <= alpha < 1 and 0 <= momentum < 1")
    if config.activation_shift < 0 or config.shift_window < 1:
        raise ValueError("need activation_shift >= 0 (0: off) and shift_window >= 1 sample")
    if config.shift_prior_window is not None and config.shift_prior_window < 1:
        raise ValueError("need shift_prior_window >= 1 sample (or None: no label-shift "
                         "correction)")
    if config.free_shift < 0:
        raise ValueError("need free_shift >= 0 (0: off)")
    if config.activation_shift > 0 and not metadata.has_source_stats:
        raise ValueError("activation_shift needs the model's source statistics (run "
                         "`eva0-edge calibrate`)")
    if config.reference_batch < 1 or config.coef_window < 1 or (
        config.stat_window is not None and config.stat_window < 1
    ):
        raise ValueError("need reference_batch >= 1, coef_window >= 1, stat_window >= 1")
    if (config.coef_clip is not None and config.coef_clip <= 0) or (
        config.trust_radius is not None and config.trust_radius <= 0
    ):
        raise ValueError("coef_clip and trust_radius must be > 0 (or None: off)")
    fp = config.forwards
    if spec.adapts and (fp < 2 or fp % 2 or (fp != 2 and not config.two_sided)):
        raise ValueError(
            f"{method}: #FP (forwards) must be an even number >= 2 "
            f"(exactly 2 for one-sided methods), got {fp}"
        )
    check_budget(method, config.budget, fp, config.budget_burst)
    if not 0 <= config.bank_slots <= MAX_BANK_SLOTS or config.bank_threshold <= 0:
        raise ValueError(f"need 0 <= bank_slots <= {MAX_BANK_SLOTS} (0: no domain bank) and "
                         f"bank_threshold > 0, got {config.bank_slots} and "
                         f"{config.bank_threshold}")
    return config


def recommended_for_family(family: str) -> dict[str, Any]:
    """The paper's per-architecture values (ViT-Base / ResNet50-GN), written at export."""
    return dict(_FAMILY_RECOMMENDED.get(family, {}))


# the words a --set value may spell a boolean or None with, in any case
_WORDS: dict[str, bool | None] = {
    "true": True, "yes": True, "on": True, "false": False, "no": False, "off": False,
    "none": None, "null": None,
}


class _Words(ast.NodeTransformer):
    """Replaces the names of ``_WORDS`` (any case) in a parsed value by their constants."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        word = node.id.lower()
        if word in _WORDS:
            return ast.copy_location(ast.Constant(_WORDS[word]), node)
        return node


def parse_value(text: str) -> Any:
    """One ``--set`` value: a Python literal (``0.001``, ``256``, ``[1, 1, 1, 1]``, ``True``)
    where it parses as one, the words true/false, yes/no, on/off and none/null in any case
    as booleans and None (inside lists too: ``[on, off]``), else the text itself (a string)."""
    try:
        tree = _Words().visit(ast.parse(text.strip(), mode="eval"))
        return ast.literal_eval(tree)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_key_values(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``["eta=0.001", "guard=on", "layers=[1,1,1,1]", "norm_layer=groupnorm"]``, each
    value by :func:`parse_value`; a hyper-parameter's value is then coerced to its field's
    type, or refused naming the key and the type, when the config takes it
    (:func:`replaced`)."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad setting {item!r}: use KEY=VALUE, e.g. eta=0.001")
        values[key.strip()] = parse_value(value)
    return values
