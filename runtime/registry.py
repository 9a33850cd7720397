"""Every method eva0-edge knows, in one table.

A :class:`MethodSpec` says what a method is (``kind``: the EVA-0-family engine, FOA's CMA-ES
search, or a torch backprop baseline that only the benchmarks run), what it costs (forward
passes per sample), what it needs (a black-box prompt model), what it can do (keep a state,
run the health guard, adapt apart from serving) and how it differs from its kind's defaults
(config overrides). Everything else is derived from this table: the engine's and FOA's method
lists, the runtime methods ``adapt`` / ``eval`` / ``bench`` accept, the torch baselines of
``eval``, and the CLI's help.

Names take an optional ``@FP`` suffix, the forward passes per sample of an adapting runtime
method (``eva0-clubs@8``, ``foa-dagger@14``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("engine", "foa", "torch")
RUNTIME_KINDS = ("engine", "foa")
FOA_FORWARDS = 28  # FOA's CMA-ES population 27 + the previous best

_PLAIN = {"shortcut_resistant": False, "center": False, "anchor_per_64": 0.0, "gamma": 0.0}
# the source-free activation shift of eva0-dagger (runtime.shift.SourceFreeShift) by default:
# the family-independent strength and window chosen on the validation split of the three
# shipped models (studies/source-free/README.md); the paper's EVA-0-dagger is free_shift=0
SOURCE_FREE_SHIFT: dict[str, Any] = {"free_shift": 1.5, "free_shift_margin": 0.15,
                                     "shift_window": 256.0}


@dataclass(frozen=True)
class MethodSpec:
    """One method. ``overrides``: values applied over its kind's defaults (``AdaptConfig`` for
    the engine, ``FOAConfig`` for FOA). ``forwards_per_sample``: forward passes per sample at
    its default #FP (a torch baseline: its forwards, backward passes not counted).

    What it can do, asked of the entry and never of a type: ``keeps_state`` (a state that is
    saved, resumed, installed over HTTP and merged across a fleet), ``guard`` (the health
    guard can watch it: its bounds are calibrated on adapted norm parameters),
    ``separate_step`` (its step can run apart from serving: the asynchronous server).
    ``shift_from``: the method whose tuned activation-shift values (``config.SHIFT_KEYS``) this
    one takes when that method's shift is on (noadapt-shift takes eva0's: it is the one-forward
    tier, the same computation as eva0 at ``--budget 1``)."""

    name: str
    kind: str
    forwards_per_sample: int
    description: str
    adapts: bool = True
    prompt_model: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    keeps_state: bool = True
    guard: bool = True
    separate_step: bool = True
    shift_from: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}, got {self.kind!r}")


REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the table; ValueError if its name is taken."""
    if spec.name in REGISTRY:
        raise ValueError(f"method {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


for _spec in (
    MethodSpec("noadapt", "engine", 1, "the source model, one forward", adapts=False),
    MethodSpec("noadapt-shift", "engine", 1,
               "the source model with the activation shift as tuned for eva0 (no update), one "
               "forward: eva0 at --budget 1",
               adapts=False, overrides={"activation_shift": 1.0}, shift_from="eva0"),
    MethodSpec("eva0", "engine", 2, "EVA-0 (lambda > 0 when the model has source statistics)"),
    MethodSpec("eva0-dagger", "engine", 2,
               "EVA-0, fully source-free: E_SR only and the source-free activation shift",
               overrides={"lambda_swa": 0.0, **SOURCE_FREE_SHIFT}),
    MethodSpec("zoa", "engine", 2,
               "ZOA-style one-sided SPSA: clean forward predicts, one shared perturbed forward",
               overrides={**_PLAIN, "two_sided": False, "sample_wise": False}),
    MethodSpec("spsa2-shared", "engine", 2,
               "two-sided SPSA with one batch-shared perturbation, plain entropy",
               overrides={**_PLAIN, "sample_wise": False}),
    MethodSpec("eva0-clubs", "engine", 2,
               "EVA-0-clubs: black-box prompt adaptation with E_SR only",
               prompt_model=True, overrides={"lambda_swa": 0.0}),
    MethodSpec("foa", "foa", FOA_FORWARDS,
               "FOA: CMA-ES over input prompts, fitness entropy + feature alignment, "
               "activation shifting", prompt_model=True,
               # the CMA-ES search state is not persisted, a prompt has no calibrated guard
               # bounds, and the step serves the batch it searches on
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("foa-dagger", "foa", FOA_FORWARDS,
               "FOA-dagger: entropy-only fitness, no shifting, source-free",
               prompt_model=True, overrides={"lambda_fit": 0.0, "shift": False},
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("tent", "torch", 1, "TENT (torch, backprop; benchmarks only)",
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("sar", "torch", 2, "SAR (torch, backprop; benchmarks only)",
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("deyo", "torch", 2, "DeYO (torch, backprop; benchmarks only)",
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("bn-adapt", "torch", 1, "BN-adapt: BatchNorm with source + test-batch "
               "statistics (torch, no backprop; benchmarks only)",
               keeps_state=False, guard=False, separate_step=False),
    MethodSpec("bn-ema", "torch", 1, "BN-EMA: BatchNorm running statistics updated by every "
               "test batch (torch, no backprop; benchmarks only)",
               keeps_state=False, guard=False, separate_step=False),
):
    register(_spec)


def method_names(*kinds: str, prompt_model: bool | None = None) -> tuple[str, ...]:
    """Registered names of ``kinds`` (all kinds when none given) in table order; with
    ``prompt_model`` set, only the methods that need (True) or do not need (False) one."""
    return tuple(
        spec.name for spec in REGISTRY.values()
        if (not kinds or spec.kind in kinds)
        and (prompt_model is None or spec.prompt_model == prompt_model)
    )


def parse_method(name: str) -> tuple[str, dict[str, Any]]:
    """``"eva0-clubs@8"`` -> ``("eva0-clubs", {"forwards": 8})``; a plain name has no overrides.

    ``@FP`` sets the forward passes per sample (#FP) of an adapting method; ValueError if the
    suffix is not a positive integer.
    """
    base, sep, fp = name.partition("@")
    if not sep:
        return name, {}
    if not fp.isdigit() or int(fp) < 1:
        raise ValueError(f"bad method {name!r}: the part after @ is #FP, e.g. {base}@8")
    return base, {"forwards": int(fp)}


def spec_of(name: str, *kinds: str) -> MethodSpec:
    """The spec of ``name`` (``@FP`` allowed), of one of ``kinds`` when given; ValueError naming
    the known methods otherwise."""
    base, _ = parse_method(name)
    spec = REGISTRY.get(base)
    if spec is None or (kinds and spec.kind not in kinds):
        raise ValueError(
            f"unknown method {name!r}; known: {', '.join(method_names(*kinds))}"
        )
    return spec


def method_help(*kinds: str) -> str:
    """One line of CLI help listing the methods of ``kinds``."""
    listed = [
        f"{spec.name}{' (prompt models)' if spec.prompt_model else ''}"
        for spec in REGISTRY.values() if spec.kind in kinds
    ]
    return (f"{', '.join(listed)} (default eva0); name@FP sets the forwards per sample, "
            "e.g. eva0-clubs@8")
