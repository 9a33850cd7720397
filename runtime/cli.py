"""The ``eva0-edge`` command line.

Subcommands that need torch (``export``) import it lazily, so the device subcommands run on an
install without torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .metadata import ModelFormatError

log = logging.getLogger("eva0_edge")


def _cmd_export(args: argparse.Namespace) -> None:
    try:
        from eva0_edge.exporter import export_model, parse_model_kwargs
    except ImportError as err:
        raise SystemExit(
            "export needs the [export] extra (torch, timm): "
            f"pip install 'eva0-edge[export]' ({err})"
        ) from err
    labels = None
    if args.labels:
        with open(args.labels, encoding="utf-8") as f:
            labels = [line.strip() for line in f if line.strip()]
    input_size = tuple(int(v) for v in args.input_size.split(",")) if args.input_size else None
    metadata = export_model(
        args.arch,
        args.output,
        checkpoint=args.checkpoint,
        adapt=args.adapt,
        model_kwargs=parse_model_kwargs(args.set or []),
        labels=labels,
        input_size=input_size,
        opset=args.opset,
    )
    print(
        f"wrote {args.output}: {metadata.architecture}, theta [R, {metadata.num_params}], "
        f"features [R, {metadata.num_features}], {metadata.num_classes} classes"
    )


def _cmd_info(args: argparse.Namespace) -> None:
    from .info import describe
    from .modelfile import read_metadata

    print(describe(read_metadata(args.model), full=args.full))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eva0-edge",
        description="Backprop-free test-time adaptation (EVA-0) on ONNX Runtime.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    p.add_argument("--opset", type=int, default=18, help="ONNX opset (default 18)")
    p.add_argument("-o", "--output", required=True, help="output .onnx path")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("info", help="print an adaptable model's metadata")
    p.add_argument("model", help="adaptable .onnx file")
    p.add_argument("--full", action="store_true", help="list every theta segment")
    p.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``eva0-edge`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        args.func(args)
    except (FileNotFoundError, ModelFormatError, ValueError) as err:
        print(f"eva0-edge {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
