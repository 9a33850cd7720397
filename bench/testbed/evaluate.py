"""``eva0-edge eval``: run methods through a protocol on corrupted domains and report the paper's
table (methods x corruptions + average) as Markdown, JSON and a PNG."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.runtime.config import AdaptConfig
from eva0_edge.runtime.foa import FOAConfig
from eva0_edge.runtime.methods import RUNTIME_METHODS, base_name, is_prompt_method, load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.registry import method_names, spec_of
from eva0_edge.runtime.session import SessionSettings

from .corruptions import CORRUPTIONS
from .datasets import Domain, fmnist_c_domains, folder_domains
from .fashion_mnist import VAL_SIZE, load_fashion_mnist
from .protocols import (
    GRADUAL_SEVERITIES,
    SEVERITIES,
    SOAK_PASSES,
    StreamMethod,
    StreamResult,
    run_protocol,
)
from .report import write_report

BACKPROP = method_names("torch")
# --set lr=... : the backprop baselines' learning rate at batch 64; bn_prior / bn_momentum:
# the BatchNorm-statistics baselines' knobs (bench.testbed.bnstats)
BACKPROP_KEYS = ("lr", "bn_prior", "bn_momentum")


@dataclass
class EvalSpec:
    """What one ``eval`` run measures. ``severity``: one (1-5), or a list, each its own stream
    set (``gradual`` runs 1-5 by itself and takes only the default, 5); ``soak_passes``: how
    many times ``soak`` streams the domains."""

    model: str
    dataset: str
    protocol: str
    severity: int | list[int]
    batch_size: int
    methods: list[str]
    batch_sizes: list[int] | None = None
    corruptions: list[str] | None = None
    seed: int = 0
    limit: int | None = None
    split: str = "test"
    overrides: dict[str, Any] | None = None
    torch_checkpoint: str | None = None
    session: SessionSettings = field(default_factory=SessionSettings)
    prompt_model: str | None = None
    soak_passes: int = SOAK_PASSES


def known_methods() -> list[str]:
    return [*RUNTIME_METHODS, *BACKPROP]


def check_method(name: str) -> None:
    if name not in BACKPROP:
        try:
            base_name(name)
        except ValueError as err:
            raise ValueError(f"{err}; backprop baselines: {', '.join(BACKPROP)}") from err


def split_overrides(overrides: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--set`` values -> (EVA-0-family settings, FOA settings); ValueError for a key that is
    none of those nor a torch baseline's (``lr``)."""
    engine_keys = {f.name for f in fields(AdaptConfig)}
    foa_keys = {f.name for f in fields(FOAConfig)}
    values = dict(overrides or {})
    known = engine_keys | foa_keys | set(BACKPROP_KEYS)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown hyper-parameter(s) {unknown}; known: {sorted(known)}")
    return (
        {k: v for k, v in values.items() if k in engine_keys},
        {k: v for k, v in values.items() if k in foa_keys},
    )


def method_factory(spec: EvalSpec, name: str) -> Callable[[], StreamMethod]:
    """A constructor of a fresh ``name`` method on the spec's model (the prompt methods on its
    prompt variant, see :func:`model_for`)."""
    if name not in BACKPROP:
        engine, foa = split_overrides(spec.overrides)
        config = foa if spec_of(name).kind == "foa" else engine
        path = model_for(spec, name)
        return lambda: load_method(path, name, config, spec.seed, spec.session)
    import torch

    from .backprop import BackpropTTA, load_torch_source
    from .bnstats import BN_METHODS, DEFAULTS, BatchNormStats

    if spec.session.threads:
        torch.set_num_threads(spec.session.threads)
    metadata = read_metadata(spec.model)
    if metadata.quantization:
        raise ValueError(
            f"{name} runs in torch on float weights; {spec.model} is quantized "
            f"({metadata.quantization['scheme']}), so the comparison would not be like for "
            "like: evaluate it on the float model"
        )
    model = load_torch_source(metadata, spec.torch_checkpoint)
    if name in BN_METHODS:
        knobs = {**metadata.tuned.get(name, {}), **{
            k: v for k, v in (spec.overrides or {}).items() if k in DEFAULTS[name]}}
        return lambda: BatchNormStats(name, model, knobs)
    lr = (spec.overrides or {}).get("lr", metadata.tuned.get(name, {}).get("lr"))
    return lambda: BackpropTTA(name, model, metadata, lr, spec.batch_size, spec.seed)


def model_for(spec: EvalSpec, name: str) -> str:
    """The file ``name`` runs on: ``spec.model``, or for a prompt method the spec's prompt model
    (given, the model itself, or the cached prompt variant of a shipped model)."""
    if not is_prompt_method(name):
        return spec.model
    if spec.prompt_model:
        return spec.prompt_model
    from .prompt_variant import prompt_variant

    return str(prompt_variant(spec.model, torch_checkpoint=spec.torch_checkpoint))


def stream_sets(spec: EvalSpec) -> list[tuple[int, ...]]:
    """The severities of each stream set ``spec`` runs: one set per listed severity, or
    ``gradual``'s one set of all five; ValueError for a severity outside 1-5, one listed
    twice, or ``gradual`` given a severity other than the default."""
    listed = [spec.severity] if isinstance(spec.severity, int) else list(spec.severity)
    if not listed or not set(listed) <= set(SEVERITIES) or len(set(listed)) < len(listed):
        raise ValueError(f"severities are distinct values in 1..5, got {spec.severity}")
    if spec.protocol == "gradual":
        if listed != [5]:
            raise ValueError("--protocol gradual streams severities 1->5->1 within each "
                             f"corruption by itself; leave --severity out (got {spec.severity})")
        return [tuple(sorted(set(GRADUAL_SEVERITIES)))]
    return [(s,) for s in listed]


def load_domains(spec: EvalSpec, progress: bool = True) -> list[Domain]:
    """Fashion-MNIST-C (``fmnist-c``) or an ImageNet-C-style folder at every severity the spec
    streams (:func:`stream_sets`; the domains one severity after another); a seeded subset of
    ``limit`` images of each domain when a limit is set (the same images in every domain and
    severity). ``spec.corruptions`` picks domains (``clean``: the uncorrupted images);
    default: all 15."""
    return [d for levels in stream_sets(spec) for severity in levels
            for d in _domains_at(replace(spec, severity=severity), progress)]


def _domains_at(spec: EvalSpec, progress: bool) -> list[Domain]:
    """:func:`load_domains` at the spec's one severity."""
    rng = np.random.default_rng(spec.seed)
    if spec.dataset == "fmnist-c":
        indices = None
        if spec.limit:
            size = VAL_SIZE if spec.split == "val" else len(load_fashion_mnist(spec.split)[1])
            indices = np.sort(rng.choice(size, min(spec.limit, size), replace=False))
        return fmnist_c_domains(
            spec.severity, spec.split, corruptions=spec.corruptions or CORRUPTIONS,
            indices=indices, progress=progress,
        )
    domains = folder_domains(spec.dataset, spec.severity, spec.corruptions)
    if spec.limit:
        domains = [
            d.subset(np.sort(rng.choice(len(d), min(spec.limit, len(d)), replace=False)))
            for d in domains
        ]
    return domains


def evaluate(
    spec: EvalSpec, out_dir: str | os.PathLike | None = None, progress: bool = True,
    domains: list[Domain] | None = None,
) -> dict[str, StreamResult]:
    """Run every method of ``spec`` at every batch size and severity, on ``domains`` when
    given (else the spec's dataset; with several severities, each stream set takes the given
    domains of its severity); write the report to ``out_dir`` if given. Keys: the method
    name, with `` B=<batch>`` appended when several batch sizes run and `` S=<severity>``
    when several severities do."""
    for name in spec.methods:
        check_method(name)
    split_overrides(spec.overrides)
    sizes = batch_sizes(spec)
    sets = stream_sets(spec)
    metadata = read_metadata(spec.model)
    if domains is None:
        domains = load_domains(spec, progress)
    results = {}
    for levels in sets:
        streamed = domains if len(sets) == 1 else [d for d in domains if d.severity in levels]
        for batch in sizes:
            batch_spec = replace(spec, batch_size=batch, batch_sizes=None)
            for name in spec.methods:
                key = (name + ("" if len(sizes) == 1 else f" B={batch}")
                       + ("" if len(sets) == 1 else f" S={levels[0]}"))
                results[key] = run_protocol(
                    name, method_factory(batch_spec, name), streamed, spec.protocol, batch,
                    metadata.preprocessing, spec.seed, progress, spec.soak_passes,
                )
                results[key].severity = levels[0] if len(levels) == 1 else None
    if out_dir is not None:
        write_report(results, spec_dict(spec), Path(out_dir))
    return results


def batch_sizes(spec: EvalSpec) -> list[int]:
    """The batch sizes ``spec`` runs (``batch_sizes``, else ``batch_size``); ValueError if any
    is below 1."""
    sizes = list(spec.batch_sizes or [spec.batch_size])
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {sizes}")
    return sizes


def spec_dict(spec: EvalSpec) -> dict[str, Any]:
    """The spec as the report's JSON has it: the model's file name, ``soak_passes`` only for
    ``soak`` (the one protocol it changes)."""
    values = asdict(spec)
    values["model"] = str(Path(spec.model).name)
    if spec.protocol != "soak":
        del values["soak_passes"]
    return values
