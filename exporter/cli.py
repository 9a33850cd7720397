"""``eva0-edge export``: a timm model -> an adaptable ONNX model (needs the [export] extra)."""

from __future__ import annotations

import argparse
from typing import Any

from eva0_edge.runtime.cli import int_in, missing_extra
from eva0_edge.runtime.config import parse_key_values


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"need comma-separated numbers, got {text!r}") from err


def _cmd_export_onnx(args: argparse.Namespace, labels: list[str] | None) -> None:
    """``export --onnx``: any ONNX classifier in (no torch needed)."""
    from eva0_edge.exporter.graph import list_affines, make_adaptable
    from eva0_edge.runtime.metadata import Preprocessing
    from eva0_edge.runtime.progress import heartbeat

    if args.list:
        for index, op, name, shape in list_affines(args.onnx, args.logits):
            print(f"{index:4d}  {op:24s} {name}  {list(shape)}")
        return
    if args.output is None:
        raise SystemExit("error: export --onnx needs -o/--output (or --list)")
    preprocessing = None
    if args.mean or args.std:
        if not (args.mean and args.std):
            raise SystemExit("error: --mean and --std go together")
        import onnx

        dims = onnx.load(args.onnx, load_external_data=False).graph.input[0].type.tensor_type
        size = tuple(int(d.dim_value) for d in dims.shape.dim[1:])
        preprocessing = Preprocessing(size, args.mean, args.std,  # type: ignore[arg-type]
                                      args.interpolation or "bilinear", args.crop_pct or 1.0)
    with heartbeat(f"rewriting {args.onnx}", quiet=args.quiet):
        metadata = make_adaptable(args.onnx, args.output, adapt=args.adapt, labels=labels,
                                  preprocessing=preprocessing, logits=args.logits)
    print(f"wrote {args.output}: {metadata.architecture}, theta [R, {metadata.num_params}] "
          f"({len(metadata.theta_layout) // 2} affines, {metadata.adapt}), features "
          f"[R, {metadata.num_features}], {metadata.num_classes} classes")


def _normalisation(args: argparse.Namespace, metadata: Any) -> Any:
    """``export --arch`` with --mean / --std (and --interpolation / --crop-pct when given):
    the written file's preprocessing, in place of timm's data config (a model of your own
    trained with its own normalisation); returns the new metadata."""
    from dataclasses import replace

    from eva0_edge.runtime.modelfile import load_onnx, save_onnx, set_metadata

    if not (args.mean and args.std):
        raise ValueError("--mean and --std go together")
    channels = metadata.preprocessing.input_size[0]
    if len(args.mean) != channels or len(args.std) != channels:
        raise ValueError(f"--mean and --std need {channels} values (one per channel)")
    pre = metadata.preprocessing
    metadata.preprocessing = replace(
        pre, mean=args.mean, std=args.std, interpolation=args.interpolation or pre.interpolation,
        crop_pct=pre.crop_pct if args.crop_pct is None else args.crop_pct)
    model = load_onnx(args.output)
    save_onnx(set_metadata(model, metadata), args.output)
    return metadata


def _cmd_export(args: argparse.Namespace) -> None:
    from eva0_edge.runtime.progress import heartbeat

    labels = None
    if args.labels:
        with open(args.labels, encoding="utf-8") as f:
            labels = [line.strip() for line in f if line.strip()]
    if args.onnx:
        _cmd_export_onnx(args, labels)
        return
    try:
        from eva0_edge.exporter import export_model
    except ImportError as err:
        raise missing_extra("export", "export", err) from err
    if args.output is None:
        raise SystemExit("error: export needs -o/--output")
    input_size = tuple(int(v) for v in args.input_size.split(",")) if args.input_size else None
    with heartbeat(f"exporting {args.arch}", quiet=args.quiet):
        metadata = export_model(
            args.arch,
            args.output,
            checkpoint=args.checkpoint,
            adapt=args.adapt,
            model_kwargs=parse_key_values(args.set or []),
            labels=labels,
            input_size=input_size,
            opset=args.opset,
            prompts=args.prompts,
            prompt_seed=args.prompt_seed,
        )
    if args.mean or args.std:
        metadata = _normalisation(args, metadata)
    adapted = (
        f"black-box prompt [R, {', '.join(map(str, metadata.theta_layout[0].shape))}]"
        if metadata.is_prompt_model else f"theta [R, {metadata.num_params}]"
    )
    print(
        f"wrote {args.output}: {metadata.architecture}, {adapted}, "
        f"features [R, {metadata.num_features}], {metadata.num_classes} classes"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="timm model or ONNX classifier -> adaptable ONNX model")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--arch", help="timm architecture, e.g. vit_base_patch16_224")
    source.add_argument("--onnx", metavar="FILE",
                        help="any ONNX image classifier (torch.onnx, tf2onnx, an optimiser's "
                        "output): rewritten to an adaptable file; needs no torch")
    p.add_argument("--checkpoint", help="local timm/torch state dict (random init if omitted)")
    p.add_argument(
        "--adapt",
        help="blocks (ViT, 0-based) or stages (ResNet, 1..4) to adapt, e.g. 2-8 "
        "(default: 2-8 for deep ViTs, 1-3 for ResNets; each family's units in `eva0-edge "
        "export --help`'s guide page); with --onnx: affine indices ('20-52', see --list) or "
        "name patterns ('blocks.4.*,blocks.5.*') (default: the later half)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="timm.create_model kwarg, repeatable: --set img_size=32 --set num_classes=10",
    )
    p.add_argument("--input-size", help="C,H,W the model expects (default: from the model)")
    p.add_argument("--labels", help="text file with one class name per line")
    p.add_argument("--opset", type=int_in(17), default=18, help="ONNX opset, >= 17 (default 18)")
    p.add_argument("--prompts", type=int_in(0), default=0, metavar="T",
                   help="ViT black-box prompt mode: T prompt tokens after CLS as the only "
                   "adaptable input, weights frozen (for foa / foa-dagger / eva0-clubs)")
    p.add_argument("--prompt-seed", type=int, default=0, help="initial prompt seed (default 0)")
    p.add_argument("--logits", metavar="NAME",
                   help="with --onnx: the logits output, when the graph has several")
    p.add_argument("--mean", type=_floats, help="per-channel mean the model was trained with, "
                   "e.g. 0.485,0.456,0.406 (default: --arch timm's data config; --onnx a "
                   "sidecar JSON, else ImageNet's)")
    p.add_argument("--std", type=_floats, help="per-channel std, with --mean")
    p.add_argument("--interpolation", help="with --mean/--std (default: --arch timm's, "
                   "--onnx bilinear)")
    p.add_argument("--crop-pct", type=float, help="with --mean/--std (default: --arch timm's, "
                   "--onnx 1)")
    p.add_argument("--list", action="store_true",
                   help="with --onnx: print the adaptable affines and their indices, write nothing")
    p.add_argument("-o", "--output", help="output .onnx path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.set_defaults(func=_cmd_export)

