"""Human-readable summary of an adaptable model's metadata (``eva0-edge info``)."""

from __future__ import annotations

from .metadata import ModelMetadata, Segment


def _segments(segments: list[Segment], limit: int) -> list[str]:
    rows = [f"    {s.name:<40} offset {s.offset:>8}  size {s.size:>7}" for s in segments]
    if len(rows) > limit:
        rows = rows[: limit // 2] + [f"    ... {len(rows) - limit} more ..."] + rows[-limit // 2 :]
    return rows


def _source_stats(metadata: ModelMetadata) -> str:
    if not metadata.has_source_stats:
        return "no (lambda = 0 only, no activation shift)"
    if "head_input_mean" in metadata.arrays:
        return "yes, with the classifier input's mean (activation shift)"
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
        f"recommended      {metadata.recommended or '-'}",
        f"tuned per method {metadata.tuned or '-'}",
        f"format version   {metadata.format_version}",
        "theta layout:",
        *_segments(metadata.theta_layout, 10**9 if full else 12),
        "feature layout:",
        *_segments(metadata.feature_layout, 10**9 if full else 12),
    ]
    return "\n".join(lines)
