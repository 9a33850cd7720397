"""``eva0-edge quantize``: post-training quantization that keeps the model adaptable."""

from __future__ import annotations

import argparse


def _cmd_quantize(args: argparse.Namespace) -> None:
    from eva0_edge.runtime.data import open_input
    from eva0_edge.runtime.modelfile import read_metadata

    from . import quantize_model

    metadata = read_metadata(args.model)
    stream = open_input(args.calib, metadata.preprocessing)
    if len(stream) < args.calib_images:
        raise ValueError(f"--calib has {len(stream)} images, --calib-images asks for "
                         f"{args.calib_images}")
    _, calibration, _ = next(stream.batches(args.calib_images))
    quantized = quantize_model(args.model, args.output, args.bits, calibration, args.scheme)
    q = quantized.quantization
    print(f"wrote {args.output}: {q['scheme']} W{q['bits']}A{q['bits']}, calibrated on "
          f"{len(calibration)} images")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="post-training quantization (still adaptable)")
    p.add_argument("--model", required=True, help="adaptable .onnx file (float32)")
    p.add_argument("--bits", type=int, required=True, choices=[8, 6])
    p.add_argument("--calib", required=True,
                   help="calibration images: folder, .npy or .npz (the first --calib-images)")
    p.add_argument("--calib-images", type=int, default=32, help="default 32")
    p.add_argument("--scheme", default="ptq4vit", choices=["ptq4vit", "int8"],
                   help="ptq4vit: PTQ4ViT-like fake quantization (accuracy); int8: integer "
                   "kernels in ONNX Runtime (speed). Default ptq4vit")
    p.add_argument("-o", "--output", required=True, help="output .onnx path")
    p.set_defaults(func=_cmd_quantize)

