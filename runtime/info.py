"""Human-readable summary of an adaptable model's metadata (``eva0-edge info``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .metadata import ModelMetadata, Segment

# the eva0 values that say what the guard, the shifts and the source-free mode run with (the
# rest are rates)
SAFETY_KEYS = {"guard", "activation_shift", "shift_window", "shift_max", "free_shift",
               "free_shift_margin", "lambda_swa"}


def _segments(segments: list[Segment], limit: int) -> list[str]:
    rows = [f"    {s.name:<40} offset {s.offset:>8}  size {s.size:>7}" for s in segments]
    if len(rows) > limit:
        rows = rows[: limit // 2] + [f"    ... {len(rows) - limit} more ..."] + rows[-limit // 2 :]
    return rows


def _source_stats(metadata: ModelMetadata) -> str:
    if not metadata.has_source_stats:
        return "no (lambda = 0 only, no activation shift)"
    if "head_input_class_means" in metadata.arrays:
        return ("yes, with the classifier input's mean and per-class means (activation shift, "
                "label-shift correction)")
    if "head_input_mean" in metadata.arrays:
        return ("yes, with the classifier input's mean (activation shift; recalibrate for the "
                "label-shift correction)")
    return "yes (no classifier-input mean: recalibrate for the ViT's activation shift)"


def _quantization(quant: dict) -> str:
    """'none (float32)', or the scheme, width and encoding the quantizer recorded."""
    if not quant:
        return "none (float32)"
    bits = quant.get("bits")
    width = f" W{bits}A{bits}" if bits else ""
    encoding = f"; {quant['encoding']}" if quant.get("encoding") else ""
    return f"{quant.get('scheme', '?')}{width}{encoding}"


def describe(metadata: ModelMetadata, *, full: bool = False) -> str:
    """A multi-line report of ``metadata``; ``full`` lists every theta segment."""
    pre = metadata.preprocessing
    labels = metadata.labels
    shown = ", ".join(labels[:10]) + (f", ... ({len(labels)} in all)" if len(labels) > 10 else "")
    quant = metadata.quantization or {}
    lines = [
        f"architecture     {metadata.architecture} (family {metadata.family})",
        f"classes          {metadata.num_classes}: {shown}",
        f"input            pixel_values [N, {', '.join(map(str, pre.input_size))}] float32",
        f"preprocessing    resize {pre.interpolation}, crop {pre.crop_mode} {pre.crop_pct:g}, "
        f"mean {list(pre.mean)}, std {list(pre.std)}",
        (
            f"adapted          black box: prompt [R, "
            f"{', '.join(map(str, metadata.theta_layout[0].shape))}] after CLS, weights frozen"
            if metadata.is_prompt_model
            else f"adapted          {metadata.adapt} -> theta [R, {metadata.num_params}] "
            f"({len(metadata.theta_layout)} tensors)"
        ),
        f"shared prefix    {metadata.prefix} (runs once per image)",
        f"features         [R, {metadata.num_features}] from {len(metadata.feature_layout)} taps",
        f"source stats     {_source_stats(metadata)}",
        f"quantization     {_quantization(quant)}",
        *(f"{name:<17}{line}" for name, line in describe_fitted(metadata).items()),
        f"recommended      {metadata.recommended or '-'}",
        f"tuned per method {metadata.tuned or '-'}",
        f"format version   {metadata.format_version}",
        "theta layout:",
        *_segments(metadata.theta_layout, 10**9 if full else 12),
        "feature layout:",
        *_segments(metadata.feature_layout, 10**9 if full else 12),
    ]
    return "\n".join(lines)


def describe_fitted(metadata: ModelMetadata) -> dict[str, str]:
    """One line each for the guard, the activation shift and the rates: what is fitted and
    from what (``eva0-edge info``)."""
    eva0 = metadata.tuned.get("eva0", {})
    fitted = metadata.fitted

    def data(entry: Mapping[str, Any]) -> str:
        severity = f" at severity {entry['severity']}" if entry.get("severity") else ""
        return (f"{entry['by']} on {entry['clean_images']} clean images and "
                f"{entry['corruptions']} corruptions of them{severity} "
                f"(margin {entry['margin']:g})")

    if "guard" in fitted:
        guard = f"fitted by {data(fitted['guard'])}, " + ("on" if eva0.get("guard") else "off")
    elif eva0.get("guard"):
        guard = "on, bounds from the file (no record of their data)"
    else:
        guard = "never fitted (off): run `eva0-edge calibrate --data clean/`"
    if not eva0.get("activation_shift"):
        shift = "off" + ("" if metadata.has_source_stats else " (needs source statistics)")
    else:
        bound = (f", bound {eva0['shift_max']:g} fitted by {data(fitted['activation_shift'])}"
                 if "activation_shift" in fitted else
                 f", bound {eva0.get('shift_max', 'none')}")
        window = eva0.get("shift_window")
        shift = (f"strength {eva0['activation_shift']:g} over "
                 f"{'?' if window is None else format(window, 'g')} samples{bound}")
    rates = fitted.get("rates")
    if rates:
        chosen = ", ".join(f"{k} {v:g}" for k, v in rates.get("values", {}).items())
        tuned = f"tuned by {rates['by']} on {rates['images']} labelled images ({chosen})"
    elif rates_tuned(metadata, "eva0"):
        tuned = "tuned (no record of the data)"
    else:
        tuned = "the paper's defaults, never tuned for this model: run `eva0-edge tune`"
    return {"guard": guard, "activation shift": shift, "rates": tuned}


def guard_fitted(metadata: ModelMetadata) -> bool:
    """Whether the file's guard bounds were fitted (by ``calibrate`` or a recipe)."""
    return "guard" in metadata.fitted or any(
        k.startswith("guard_") and k != "guard_audit" for k in metadata.recommended)


def rates_tuned(metadata: ModelMetadata, method: str) -> bool:
    """Whether the file holds rates tuned for ``method`` (not only the guard and the shift)."""
    return any(k not in SAFETY_KEYS for k in metadata.tuned.get(method, {}))


def unfitted_warning(
    metadata: ModelMetadata, method: str, values: Mapping[str, Any]
) -> str | None:
    """One line for ``adapt`` / ``serve`` when EVA-0 (or its source-free form) runs on a model
    whose guard or rates were never fitted; None otherwise, or when ``values`` (the user's
    overrides) set them."""
    base = method.split("@")[0]
    if base not in ("eva0", "eva0-dagger"):
        return None
    missing = []
    if not guard_fitted(metadata) and "guard" not in values:
        missing.append("the health guard (off: `eva0-edge calibrate --data clean/` fits it)")
    if not rates_tuned(metadata, base) and "eta" not in values:
        missing.append("the rates (the paper's: `eva0-edge tune --data labelled/` tunes them)")
    if not missing:
        return None
    return f"{metadata.architecture}: {' and '.join(missing)} never fitted to this model"
