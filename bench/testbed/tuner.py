"""The tuning run of ``eva0-edge tune`` and ``models/recipes/tune.py``: every configuration of a
grid scored on the same validation images, at several batch sizes, in the single and the
continual protocol (or any of :data:`.protocols.PROTOCOLS`, at one severity or several) and on
clean images, and the rule of :func:`.tuning.choose` applied.

The images are the caller's (:class:`TuneData`): the shipped models' recipe passes
Fashion-MNIST-C's validation split, ``eva0-edge tune`` the user's labelled images and the
testbed's corruptions of them. Rule: among the configurations that never lose more than the
clean margin (0.5 points) to NoAdapt on the clean images, the best worst corrupted cell (the
product must gain at every batch size and in both protocols, not on average; ties go to the
better mean); if none qualifies, the best worst case over all cells (accuracy minus NoAdapt's).
While the best sits on an edge of a one-axis grid, the next point past it is scored too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from eva0_edge.runtime.config import AdaptConfig
from eva0_edge.runtime.foa import FOA_METHODS, FOAConfig
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.progress import progress_bar
from eva0_edge.runtime.session import SessionSettings

from .backprop import PAPER_LR
from .bnstats import BN_METHODS
from .bnstats import DEFAULTS as BN_DEFAULTS
from .datasets import Domain
from .evaluate import BACKPROP, EvalSpec, evaluate
from .protocols import RESETTING, SEVERITIES, schedule, stream_batches
from .tuning import beyond_edge, choose, spending_bound

PROTOCOLS = ("single", "continual")  # the protocols scored by default
SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
EVA0_ONLY = {"activation_shift", "shift_window", "shift_max"}


@dataclass
class TuneData:
    """The validation images a tuning scores on: the corrupted domains (streamed per
    protocol, at each of ``severity``'s severities; ``gradual`` streams them at 1-5, so a
    tuning with it holds every corruption at every severity) and the clean domain(s);
    ``dataset`` and ``severity`` name them in the log."""

    corrupted: list[Domain]
    clean: list[Domain]
    dataset: str
    severity: int | list[int]


def corrupted_sets(data: TuneData, protocol: str) -> list[tuple[str, int, list[Domain]]]:
    """The stream sets ``protocol`` scores: (cell infix, the spec's severity, domains) each;
    one per severity (infix `` S=<s>`` when several), ``gradual``'s one of every severity;
    ValueError for a severity no corrupted domain has."""
    if protocol == "gradual":
        return [("", 5, [d for d in data.corrupted if d.severity in SEVERITIES])]
    listed = severities_of(data)
    sets = []
    for severity in listed:
        domains = [d for d in data.corrupted if d.severity == severity]
        if not domains:
            raise ValueError(f"no corrupted validation domain at severity {severity}")
        sets.append(("" if len(listed) == 1 else f" S={severity}", severity, domains))
    return sets


def severities_of(data: TuneData) -> list[int]:
    """The severities the corrupted protocols other than ``gradual`` score."""
    return [data.severity] if isinstance(data.severity, int) else list(data.severity)


def _batches(domains: list[Domain], protocol: str, batch: int) -> int:
    """The batches one run of ``protocol`` over ``domains`` streams at batch size ``batch``."""
    return stream_batches(schedule(domains, protocol, 0), batch)


@dataclass
class TuneSettings:
    """How every configuration is scored: batch sizes, corrupted protocols, the rule's clean
    margin (points) and forwards bound, the values every configuration runs with (``fixed``),
    the points scored past a grid edge (``extend``), and ORT / torch threads."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    protocols: list[str] = field(default_factory=lambda: list(PROTOCOLS))
    clean_margin: float = 0.5
    max_forwards: float | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    extend: int = 2
    threads: int | None = 1


def current_values(model: str, method: str) -> dict[str, float]:
    """The step size ``method`` runs with today on ``model`` (before tuning)."""
    metadata = read_metadata(model)
    if method in FOA_METHODS:
        return {"lambda_fit": FOAConfig().updated(metadata.tuned.get(method, {})).lambda_fit}
    if method in BN_METHODS:
        (key, value), = {**BN_DEFAULTS[method], **metadata.tuned.get(method, {})}.items()
        return {key: float(value)}
    if method in BACKPROP:
        default = PAPER_LR.get(metadata.family, 1e-3)
        return {"lr": metadata.tuned.get(method, {}).get("lr", default)}
    return {"eta": Policy.load(model, method, provider="cpu").config.eta}


def default_grid(model: str, method: str) -> list[dict[str, float]]:
    """The step size at :data:`SCALES` times its current value."""
    (key, value), = current_values(model, method).items()
    return [{key: float(f"{value * s:.6g}")} for s in SCALES]


def tunable_keys(method: str) -> set[str]:
    """The keys a grid may set for ``method``."""
    if method in FOA_METHODS:
        return set(FOAConfig.__dataclass_fields__)
    if method in BN_METHODS:
        return set(BN_DEFAULTS[method])
    if method in BACKPROP:
        return {"lr"}
    return set(AdaptConfig.__dataclass_fields__)


def cell_batches(data: TuneData, settings: TuneSettings, batch_sizes: list[int] | None = None,
                 protocols: list[str] | None = None) -> int:
    """The batches one scoring streams (the progress bar's unit)."""
    sizes = batch_sizes or settings.batch_sizes
    corrupted = sum(_batches(domains, protocol, b) for protocol in protocols or settings.protocols
                    for _, _, domains in corrupted_sets(data, protocol) for b in sizes)
    clean = sum(-(-len(d) // b) for d in data.clean for b in sizes)
    return corrupted + clean


def score(
    model: str, method: str, data: TuneData, settings: TuneSettings,
    overrides: dict[str, Any], bar: Any = None, batch_sizes: list[int] | None = None,
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Accuracy (%) per cell, ``<protocol> B=<b>`` (corrupted average; ``<protocol> S=<s>
    B=<b>`` with several severities) and ``clean B=<b>``, each corrupted cell's measured
    forwards per sample, and (with ``settings.max_forwards``) the most a budget of that many
    forwards may spend in the cell; ``settings.fixed`` applies under ``overrides``."""
    common = dict(
        model=model, dataset=data.dataset, batch_size=64,
        methods=[method], split="val", overrides={**settings.fixed, **overrides},
        session=SessionSettings(provider="cpu", threads=settings.threads),
    )
    cells, forwards, bounds = {}, {}, {}
    for protocol in settings.protocols:
        for infix, severity, domains in corrupted_sets(data, protocol):
            for batch in batch_sizes or settings.batch_sizes:
                spec = EvalSpec(protocol=protocol, severity=severity, batch_sizes=[batch],
                                **common)
                r = evaluate(spec, progress=False, domains=domains)[method]
                cell = f"{protocol}{infix} B={r.batch}"
                cells[cell], forwards[cell] = r.average, r.forwards_per_sample
                if settings.max_forwards is not None:
                    # the bound counts the samples between resets: a never-reset stream's all
                    bounds[cell] = spending_bound(
                        settings.max_forwards, "single" if protocol in RESETTING else "continual",
                        r)
                if bar is not None:
                    bar.update(_batches(domains, protocol, batch))
    for batch in batch_sizes or settings.batch_sizes:
        spec = EvalSpec(protocol="single", severity=severities_of(data)[0],
                        batch_sizes=[batch], **common)
        r = evaluate(spec, progress=False, domains=data.clean)[method]
        cells[f"clean B={r.batch}"] = r.average
        if bar is not None:
            bar.update(sum(-(-len(d) // batch) for d in data.clean))
    return cells, forwards, bounds


def noadapt_reference(
    model: str, data: TuneData, settings: TuneSettings, bar: Any = None
) -> dict[str, float]:
    """NoAdapt on the same images (it does not depend on the batch size)."""
    plain = TuneSettings(**{**settings.__dict__, "fixed": {}})
    cells, _, _ = score(model, "noadapt", data, plain, {}, bar, batch_sizes=[64])
    return {
        f"{cell.removesuffix(' B=64')} B={b}": value
        for cell, value in cells.items() for b in settings.batch_sizes
    }


def run_tuning(
    model: str, method: str, configs: list[dict[str, Any]], data: TuneData,
    settings: TuneSettings, progress: bool = True, echo: Any = None,
    reference: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Score NoAdapt (unless its ``reference`` cells on the same data are given: a second
    stage's) and every configuration, extend past a grid edge, apply the rule; the log
    (``best`` is the winner's row). ``echo`` receives NoAdapt's cells, then every scored row
    (the recipe prints them as JSON lines). Progress: one bar over every batch streamed, with
    its time left."""
    unknown = {k for c in configs for k in c} - tunable_keys(method)
    if unknown:
        raise ValueError(f"grid keys {sorted(unknown)} do not apply to {method}")
    start = time.time()
    per_config = cell_batches(data, settings)
    reference_batches = 0 if reference is not None else cell_batches(data, settings, [64])
    bar = progress_bar(total=reference_batches + per_config * len(configs),
                       desc=f"tune {method}", unit="batch", quiet=not progress)
    with bar:
        if reference is None:
            reference = noadapt_reference(model, data, settings, bar)
        if echo:
            echo({"noadapt": reference})

        def scored(config: dict[str, Any]) -> dict[str, Any]:
            cells, forwards, bounds = score(model, method, data, settings, config, bar)
            row = {"config": config, "cells": cells, "forwards": forwards,
                   "forwards_bound": bounds}
            if echo:
                echo(row)
            return row

        rows = [scored(config) for config in configs]
        best = choose(rows, reference, settings.clean_margin, settings.max_forwards)
        for _ in range(settings.extend):
            beyond = beyond_edge(best["config"], [row["config"] for row in rows])
            if beyond is None:
                break
            bar.total += per_config
            rows.append(scored(beyond))
            best = choose(rows, reference, settings.clean_margin, settings.max_forwards)
    return {
        "method": method, "split": "val", "dataset": data.dataset, "severity": data.severity,
        "batch_sizes": settings.batch_sizes, "clean_margin": settings.clean_margin,
        "protocols": settings.protocols, "fixed": settings.fixed,
        "max_forwards": settings.max_forwards, "noadapt": reference, "best": best,
        "grid": rows, "seconds": time.time() - start, "load_average": os.getloadavg(),
    }


def write_choice(model_path: str, method: str, values: dict[str, Any],
                 record: dict[str, Any] | None = None) -> None:
    """Store ``values`` as ``method``'s tuned values in the model file (eva0's also as the
    file's recommended values, the activation shift excepted: NoAdapt and the peers read
    those); ``record``: the file's ``fitted["rates"]`` entry (what they were tuned on)."""
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    metadata.tuned = {**metadata.tuned, method: {**metadata.tuned.get(method, {}), **values}}
    if method == "eva0":
        shared = {k: v for k, v in values.items() if k not in EVA0_ONLY}
        metadata.recommended = {**metadata.recommended, **shared}
    if record is not None:
        key = "rates" if method == "eva0" else f"rates {method}"
        metadata.fitted = {**metadata.fitted, key: record}
    save_onnx(set_metadata(model, metadata), model_path)
