"""timm model (+ local checkpoint) -> one self-contained adaptable ``.onnx`` file."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import timm
import torch

from eva0_edge.runtime.config import recommended_for_family
from eva0_edge.runtime.metadata import ModelMetadata, Preprocessing, Segment
from eva0_edge.runtime.modelfile import save_onnx, set_metadata

from .adaptable import AdaptableModel
from .families import Family, family_for
from .graph_families import graph_family_for
from .prompt import PromptModel, initial_prompt
from .ranges import parse_range

DEFAULT_OPSET = 18


def create_source_model(
    arch: str, checkpoint: str | os.PathLike | None = None, **model_kwargs: Any
) -> torch.nn.Module:
    """Build a timm model in eval mode from a local checkpoint, or randomly initialised."""
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    try:
        model = timm.create_model(
            arch,
            pretrained=False,
            checkpoint_path=str(checkpoint) if checkpoint else None,
            **model_kwargs,
        )
    except RuntimeError as err:
        if "is not a known model" in str(err) or "Unknown model" in str(err):
            raise ValueError(f"unknown timm architecture {arch!r}") from err
        if checkpoint is None:
            raise
        raise ValueError(f"checkpoint {checkpoint} does not fit {arch}: {err}") from err
    except Exception as err:  # noqa: BLE001 - torch.load's errors on a file that is no checkpoint
        if checkpoint is None:
            raise
        raise ValueError(f"checkpoint {checkpoint} is not a loadable state dict for {arch} "
                         f"({type(err).__name__}: {err})") from err
    return model.eval()


def build_adaptable(
    model: torch.nn.Module, adapt: str | None = None
) -> tuple[AdaptableModel, Family, torch.Tensor]:
    """Split ``model`` (modified in place) into an AdaptableModel; also return theta0 [P]."""
    family_cls = family_for(model)
    spec = adapt or family_cls.default_adapt(model)
    indices = parse_range(spec, family_cls.num_units(model), "blocks/stages")
    source_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    family = family_cls(model, indices)
    family.install()
    return AdaptableModel(family).eval(), family, family.theta0(source_state)


def _preprocessing(
    model: torch.nn.Module, input_size: Sequence[int] | None
) -> Preprocessing:
    """timm's data config, with the input size the model was actually built for."""
    cfg = timm.data.resolve_data_config({}, model=model)
    if input_size is None:
        first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        channels = first_conv.in_channels
        patch_embed = getattr(model, "patch_embed", None)
        spatial = patch_embed.img_size if patch_embed is not None else cfg["input_size"][1:]
        input_size = (channels, *spatial)
    return Preprocessing(
        input_size=tuple(int(v) for v in input_size),
        mean=tuple(float(v) for v in cfg["mean"]),
        std=tuple(float(v) for v in cfg["std"]),
        interpolation=str(cfg.get("interpolation", "bilinear")),
        crop_pct=float(cfg.get("crop_pct", 1.0)),
        crop_mode=str(cfg.get("crop_mode", "center")),
    )


def export_model(
    arch: str,
    output: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    checkpoint: str | os.PathLike | None = None,
    adapt: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    labels: Sequence[str] | None = None,
    input_size: Sequence[int] | None = None,
    preprocessing: Preprocessing | None = None,
    opset: int = DEFAULT_OPSET,
    prompts: int = 0,
    prompt_seed: int = 0,
) -> ModelMetadata:
    """Export ``arch`` to an adaptable ONNX model at ``output``; return its metadata.

    The graph takes ``pixel_values`` [N, C, H, W] and ``theta`` [R, P] (R a multiple of N,
    both dynamic) and returns ``logits`` [R, K] and ``features`` [R, F]. ``input_size`` is
    (C, H, W); by default the size the model was built for (ViT) or timm's default (CNNs).
    ``model`` exports an already built timm model (modified in place) recorded as ``arch``;
    ``preprocessing`` replaces the one derived from timm's data config.

    ``prompts`` = T > 0 exports a ViT in black-box prompt mode instead (see
    :mod:`eva0_edge.exporter.prompt`): inputs ``pixel_values``, ``prompt`` [R, T, D] and
    ``head_shift`` [1, D], no ``theta``; theta0 is the initial prompt drawn with
    ``prompt_seed``.
    """
    if model is None:
        model = create_source_model(arch, checkpoint, **(model_kwargs or {}))
    model = model.eval()
    preprocessing = preprocessing or _preprocessing(model, input_size)
    num_classes = model.num_classes
    if labels is not None and len(labels) != num_classes:
        raise ValueError(f"{len(labels)} labels given for a model with {num_classes} classes")
    labels = list(labels) if labels is not None else [f"class_{i}" for i in range(num_classes)]
    if prompts < 0:
        raise ValueError(f"prompts must be >= 0, got {prompts}")
    if prompts:
        return _export_prompt_model(
            arch, model, prompts, prompt_seed, labels, preprocessing, opset, output
        )
    if graph_family_for(model) is not None and not _has_legacy_family(model):
        return _export_through_graph(
            arch, model, adapt, labels, preprocessing, opset, output)
    wrapper, family, theta0 = build_adaptable(model, adapt)

    pixel_values = torch.randn(2, *preprocessing.input_size)
    theta = theta0.unsqueeze(0).repeat(4, 1)
    tap_widths = wrapper.tap_widths(pixel_values, theta0.unsqueeze(0).repeat(2, 1))
    onnx_model = _to_onnx(
        wrapper, (pixel_values, theta), ["pixel_values", "theta"], ["logits", "features"], opset
    )

    feature_layout, offset = [], 0
    for name, width in zip(family.feature_names(), tap_widths, strict=True):
        feature_layout.append(Segment(name, offset, width, (width,)))
        offset += width
    metadata = ModelMetadata(
        architecture=arch,
        family=family.name,
        labels=labels,
        preprocessing=preprocessing,
        theta_layout=[Segment(s.name, s.offset, s.size, s.shape) for s in family.slots],
        feature_layout=feature_layout,
        adapt=",".join(str(i) for i in family.adapt),
        prefix=family.prefix_description(),
        recommended=recommended_for_family(family.name),
        arrays={"theta0": theta0.numpy()},
    )
    save_onnx(set_metadata(onnx_model, metadata), output)
    return metadata


def _has_legacy_family(model: torch.nn.Module) -> bool:
    try:
        family_for(model)
    except ValueError:
        return False
    return True


def _export_through_graph(
    arch: str,
    model: torch.nn.Module,
    adapt: str | None,
    labels: list[str],
    preprocessing: Preprocessing,
    opset: int,
    output: str | os.PathLike,
) -> ModelMetadata:
    """The plain model to ONNX, then the graph rewriter (:mod:`.graph`), with the family's
    ``--adapt`` units turned into name patterns.

    The export is constant-folded but not otherwise optimised: torch.onnx's optimiser would fold
    every BatchNorm into its convolution, and the BatchNorm nodes keep the adapted parameters
    the source model's own (theta names = state-dict keys, theta0 = the BatchNorm affines, as
    the torch baselines adapt them). ONNX Runtime folds them into the convolutions at load."""
    import onnxscript.optimizer

    from .graph import make_adaptable

    family = graph_family_for(model)
    assert family is not None
    _, patterns = family.patterns(model, adapt)
    pixel_values = torch.randn(2, *preprocessing.input_size)
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (pixel_values,), input_names=["pixel_values"], output_names=["logits"],
            dynamic_shapes=({0: batch},), opset_version=opset, dynamo=True, optimize=False,
            verbose=False,
        )
    onnxscript.optimizer.fold_constants(program.model)
    onnxscript.optimizer.remove_unused_nodes(program.model)
    return make_adaptable(program.model_proto, output, adapt=patterns, labels=labels,
                          preprocessing=preprocessing, architecture=arch, family=family.name)


def _export_prompt_model(
    arch: str,
    model: torch.nn.Module,
    tokens: int,
    seed: int,
    labels: list[str],
    preprocessing: Preprocessing,
    opset: int,
    output: str | os.PathLike,
) -> ModelMetadata:
    wrapper = PromptModel(model).eval()
    prompt0 = initial_prompt(model, tokens, seed)
    pixel_values = torch.randn(2, *preprocessing.input_size)
    prompt = prompt0.unsqueeze(0).repeat(4, 1, 1)
    head_shift = torch.zeros(1, model.num_features)
    onnx_model = _to_onnx(
        wrapper, (pixel_values, prompt, head_shift), ["pixel_values", "prompt", "head_shift"],
        ["logits", "features", "shifted_logits"], opset,
    )
    feature_layout, offset = [], 0
    for name, width in zip(wrapper.feature_names(), wrapper.feature_widths(), strict=True):
        feature_layout.append(Segment(name, offset, width, (width,)))
        offset += width
    size = prompt0.numel()
    metadata = ModelMetadata(
        architecture=arch,
        family="vit",
        labels=labels,
        preprocessing=preprocessing,
        theta_layout=[Segment("prompt", 0, size, tuple(prompt0.shape))],
        feature_layout=feature_layout,
        adapt="",
        prefix="patch_embed + pos_embed",
        adapted_input="prompt",
        black_box=True,
        recommended=recommended_for_family("vit"),
        arrays={"theta0": prompt0.reshape(-1).numpy()},
    )
    save_onnx(set_metadata(onnx_model, metadata), output)
    return metadata


def _to_onnx(
    wrapper: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    opset: int,
) -> onnx.ModelProto:
    """Dynamo export; the first input's dim 0 is the batch, the second's the (r * batch) rows."""
    batch = torch.export.Dim("batch", min=1)
    rows = torch.export.Dim("rows", min=1)
    dynamic = {input_names[0]: {0: batch}, input_names[1]: {0: rows}}
    dynamic.update({name: None for name in input_names[2:]})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper,
            args,
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=dynamic,
            opset_version=opset,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    return program.model_proto
