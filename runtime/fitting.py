"""Fit the health guard's bounds and the activation shift's bound to a model's own signals.

What ``eva0-edge calibrate --data clean/`` runs after the source statistics, and what the
shipped models' recipes (``models/recipes/guard_bounds.py``, ``shift_bound.py``) call:

* **guard bounds**: EVA-0 runs with the guard watching but never tripping over the streams a
  healthy device sees, the clean images and a continual stream of their corruptions, at
  batch sizes 1, 16 and 64; every windowed signal of :mod:`.guard` is recorded from the
  guard's warm-up on (as the guard checks them). The bounds are the extremes seen with a
  margin (default 2): lower bounds at min / margin (entropy, spread, logit norm), upper bounds
  at max x margin (logit norm, drift, feature distance), entropy's upper bound at
  1 - (1 - max) / margin;
* **shift bound**: per domain (every corruption and the clean images) the distance
  ||m_source - m_domain|| between the source's mean head input and the domain's at theta0,
  the largest shift a healthy stream asks for; the bound is the largest distance x 1.5. A
  stream beyond it (black, white or noise frames) restarts the shift's window and is served
  unshifted (:mod:`.shift`).

:func:`write_fit` stores both in the file and turns the guard and the shift on for eva0; the
file's ``fitted`` record says from what (``eva0-edge info`` prints it). Images are uint8
[N, H, W, C] at the model's input size; the corruptions are made by the caller (the CLI uses
the testbed's generator, :func:`eva0_edge.bench.testbed.corruptions.corrupt_any`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .guard import GuardBounds
from .head import HeadError
from .metadata import ModelMetadata
from .modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from .policy import Policy
from .preprocess import preprocess_uint8
from .progress import progress_bar
from .session import AdaptableSession
from .shift import load_shift

SIGNALS = ("entropy", "spread", "logit_norm", "drift", "alignment")
WATCH_ONLY = {"guard": True, **{f"guard_{name}": None for name in GuardBounds.__dataclass_fields__}}
GUARD_MARGIN = 2.0
SHIFT_MARGIN = 1.5
BATCH_SIZES = (1, 16, 64)
# the activation shift a never-tuned model serves with: FOA's strength over the window the
# shipped models' tuning chose (256 samples); ``eva0-edge tune --grid activation_shift=...``
# tunes it
UNTUNED_SHIFT = {"activation_shift": 1.0, "shift_window": 256.0}


@dataclass
class SafetyFit:
    """What :func:`fit_safety` measured: ``bounds`` (the guard_* values), ``shift_max`` (None:
    the file's head cannot be shifted), the [min, max] of every signal per stream
    (``<stream> B=<b>``), the head-input distance per domain, and what the images were."""

    bounds: dict[str, float]
    shift_max: float | None
    extremes: dict[str, dict[str, list[float] | None]]
    distances: dict[str, float]
    clean_images: int
    corruptions: list[str]
    images_per_corruption: int
    severity: int | None
    margin: float = GUARD_MARGIN
    shift_margin: float = SHIFT_MARGIN
    shift: dict[str, float] = field(default_factory=dict)
    shift_off_reason: str | None = None

    def record(self, source: str) -> dict[str, Any]:
        """The file's ``fitted`` entries for the guard and the shift, ``source`` naming the
        command (``calibrate``, a recipe)."""
        images = (source, self.clean_images, len(self.corruptions), self.images_per_corruption,
                  self.severity)
        batch_sizes = sorted({int(k.rsplit("=", 1)[1]) for k in self.extremes})
        entries = {"guard": fit_record(*images, self.margin, batch_sizes=batch_sizes)}
        if self.shift_max is not None:
            entries["activation_shift"] = fit_record(
                *images, self.shift_margin, batch_sizes=batch_sizes, shift_max=self.shift_max)
        return entries


def fit_record(
    by: str, clean_images: int, corruptions: int, images_per_corruption: int,
    severity: int | None, margin: float, **extra: Any,
) -> dict[str, Any]:
    """One entry of a model file's ``fitted`` record: the command that fitted a feature, the
    images it saw (clean, corruptions x images each, at ``severity``), its margin, and
    ``extra`` (the batch sizes, a bound); what ``info`` prints."""
    return {"by": by, "clean_images": clean_images, "corruptions": corruptions,
            "images_per_corruption": images_per_corruption, "severity": severity,
            "margin": margin, **extra}


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


def _batches(images: np.ndarray, batch: int, metadata: ModelMetadata) -> Iterable[np.ndarray]:
    for start in range(0, len(images), batch):
        yield preprocess_uint8(images[start : start + batch], metadata.preprocessing)


def record_signals(
    model_path: str | os.PathLike, stream: Sequence[np.ndarray], batch: int,
    values: Mapping[str, Any] | None = None, threads: int | None = 1, bar: Any = None,
) -> dict[str, list[float]]:
    """Every full-window value of every guard signal along one stream: the uint8 image
    arrays of ``stream`` in order, never reset, run by eva0 under the file's values,
    ``values`` and the guard watching only."""
    model = Policy.load(model_path, "eva0", {**(values or {}), **WATCH_ONLY}, provider="cpu",
                        threads=threads)
    guard = model.guard
    assert guard is not None  # WATCH_ONLY turns it on
    seen: dict[str, list[float]] = {name: [] for name in SIGNALS}
    for images in stream:
        for x in _batches(images, batch, model.metadata):
            model.step(x)
            if bar is not None:
                bar.update(len(x))
            if guard.windows.samples < guard.warmup:
                continue
            for name, value in model.stats()["guard"]["signals"].items():
                if value is not None:
                    seen[name].append(float(value))
    return seen


def learnt_bounds(extremes: Mapping[str, Mapping[str, Any]], margin: float) -> dict[str, float]:
    """The guard_* values from the [min, max] of every signal in every stream: lower bounds
    at min / margin (entropy's upper bound: the distance to 1 divided by the margin), upper
    bounds at max x margin."""
    seen = [n for n in SIGNALS if any(e[n] for e in extremes.values())]
    if not {"entropy", "spread", "logit_norm", "drift"} <= set(seen):
        raise ValueError("the streams were too short for the guard's warm-up: give more images")
    lows = {n: min(e[n][0] for e in extremes.values() if e[n]) for n in seen}
    highs = {n: max(e[n][1] for e in extremes.values() if e[n]) for n in seen}
    bounds = {
        "guard_entropy_min": lows["entropy"] / margin,
        "guard_entropy_max": 1.0 - (1.0 - highs["entropy"]) / margin,
        "guard_spread_min": lows["spread"] / margin,
        "guard_logit_norm_min": lows["logit_norm"] / margin,
        "guard_logit_norm_max": highs["logit_norm"] * margin,
        "guard_drift_max": highs["drift"] * margin,
    }
    if "alignment" in seen:  # only with source statistics
        bounds["guard_alignment_max"] = highs["alignment"] * margin
    return {name: _rounded(value) for name, value in bounds.items()}


def head_distances(
    model_path: str | os.PathLike, domains: Mapping[str, np.ndarray], threads: int | None = 1,
) -> dict[str, float]:
    """||m_source - m_domain|| [head-input units] per domain (uint8 images each), at theta0;
    HeadError when the file's head cannot be shifted."""
    session = AdaptableSession(model_path, None, "cpu", threads=threads)
    shift = load_shift(session, 1.0, 1.0)
    metadata = session.metadata
    distances = {}
    for name, images in domains.items():
        total = np.zeros(shift.head.width)
        for x in _batches(images, 250, metadata):
            theta = np.broadcast_to(metadata.theta0, (len(x), metadata.num_params))
            _, features = session.run(x, theta)
            total += shift.head.head_input(features).sum(axis=0)
        distances[name] = float(np.linalg.norm(shift.source_mean - total / len(images)))
    return distances


def fit_safety(
    model_path: str | os.PathLike,
    clean: np.ndarray,
    corrupted: Mapping[str, np.ndarray],
    severity: int | None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    margin: float = GUARD_MARGIN,
    shift_margin: float = SHIFT_MARGIN,
    threads: int | None = 1,
    progress: bool = False,
) -> SafetyFit:
    """Fit the guard's bounds and the shift's bound on ``clean`` (uint8 [N, H, W, C]) and its
    ``corrupted`` copies (name -> uint8 images, streamed in order as one continual stream),
    for a file with source statistics. The signals are recorded with the shift the file will
    serve with (its eva0 values, else :data:`UNTUNED_SHIFT`) when its head can be shifted."""
    metadata = read_metadata(model_path)
    if not metadata.has_source_stats:
        raise ValueError(f"{model_path}: fitting the guard needs source statistics; "
                         "calibrate on clean images first")
    if len(clean) < 2 or not corrupted:
        raise ValueError("fitting needs at least 2 clean images and one corrupted domain")
    shift = shift_values(metadata)
    off_reason = None
    try:
        distances = head_distances(model_path, {**corrupted, "clean": clean}, threads)
    except HeadError as err:
        distances, shift, off_reason = {}, {"activation_shift": 0.0}, str(err)
    streams = {"clean": [clean], "continual": list(corrupted.values())}
    total = sum(len(i) for s in streams.values() for i in s) * len(batch_sizes)
    extremes: dict[str, dict[str, list[float] | None]] = {}
    with progress_bar(total=total, desc="fit guard", unit="img", quiet=not progress) as bar:
        for stream, images in streams.items():
            for batch in batch_sizes:
                seen = record_signals(model_path, images, batch, shift, threads, bar)
                extremes[f"{stream} B={batch}"] = {
                    name: [min(v), max(v)] if v else None for name, v in seen.items()}
    shift_max = (_rounded(max(distances.values()) * shift_margin) if distances else None)
    return SafetyFit(
        learnt_bounds(extremes, margin), shift_max, extremes, distances, len(clean),
        list(corrupted), max(len(i) for i in corrupted.values()), severity, margin,
        shift_margin, shift, off_reason)


def shift_values(metadata: ModelMetadata) -> dict[str, float]:
    """The activation shift eva0 serves with on this file: its tuned strength and window
    when it has them, else :data:`UNTUNED_SHIFT`."""
    tuned = metadata.tuned.get("eva0", {})
    if tuned.get("activation_shift"):
        return {k: tuned[k] for k in ("activation_shift", "shift_window") if k in tuned}
    return dict(UNTUNED_SHIFT)


def write_fit(
    model_path: str | os.PathLike, output: str | os.PathLike, fit: SafetyFit, source: str,
) -> Path:
    """Copy ``model_path`` to ``output`` with the fitted bounds in its recommended values, the
    guard and the shift on in eva0's tuned values (the paper's baselines run as published),
    and the ``fitted`` record naming ``source``."""
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    metadata.recommended = {**metadata.recommended, **fit.bounds}
    eva0 = {**metadata.tuned.get("eva0", {}), "guard": True}
    if fit.shift_max is not None:
        eva0.update({**fit.shift, "shift_max": fit.shift_max})
    else:
        eva0.pop("shift_max", None)
        eva0["activation_shift"] = 0.0
    metadata.tuned = {**metadata.tuned, "eva0": eva0}
    metadata.fitted = {k: v for k, v in metadata.fitted.items()
                       if k not in ("guard", "activation_shift")}
    metadata.fitted.update(fit.record(source))
    return save_onnx(set_metadata(model, metadata), output)


def fit_log(fit: SafetyFit, model_path: str | os.PathLike) -> dict[str, Any]:
    """A JSON-ready record of ``fit`` (``calibrate --fit-log``)."""
    return {"model": Path(model_path).name, **asdict(fit)}
