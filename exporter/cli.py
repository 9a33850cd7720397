"""``eva0-edge export``: a timm model -> an adaptable ONNX model (needs the [export] extra)."""

from __future__ import annotations

import argparse

from eva0_edge.runtime.cli import int_in, missing_extra
from eva0_edge.runtime.config import parse_key_values


def _cmd_export(args: argparse.Namespace) -> None:
    from eva0_edge.runtime.progress import heartbeat

    try:
        from eva0_edge.exporter import export_model
    except ImportError as err:
        raise missing_extra("export", "export", err) from err
    labels = None
    if args.labels:
        with open(args.labels, encoding="utf-8") as f:
            labels = [line.strip() for line in f if line.strip()]
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
    adapted = (
        f"black-box prompt [R, {', '.join(map(str, metadata.theta_layout[0].shape))}]"
        if metadata.is_prompt_model else f"theta [R, {metadata.num_params}]"
    )
    print(
        f"wrote {args.output}: {metadata.architecture}, {adapted}, "
        f"features [R, {metadata.num_features}], {metadata.num_classes} classes"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="timm model -> adaptable ONNX model")
    p.add_argument("--arch", required=True, help="timm architecture, e.g. vit_base_patch16_224")
    p.add_argument("--checkpoint", help="local timm/torch state dict (random init if omitted)")
    p.add_argument(
        "--adapt",
        help="blocks (ViT, 0-based) or stages (ResNet, 1..4) to adapt, e.g. 2-8 "
        "(default: 2-8 for deep ViTs, 1-3 for ResNets)",
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
    p.add_argument("-o", "--output", required=True, help="output .onnx path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.set_defaults(func=_cmd_export)

