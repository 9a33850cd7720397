"""``eva0-edge quantize``: post-training quantization that keeps the model adaptable."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from eva0_edge.runtime.cli import int_in

if TYPE_CHECKING:
    import numpy as np

    from eva0_edge.runtime.data import InputStream


def calibration_images(stream: InputStream, count: int) -> np.ndarray:
    """The first ``count`` decodable images of ``stream``, normalised float32 [n, C, H, W]
    (fewer when the stream has no more); undecodable files are skipped and recorded in
    ``stream.skipped`` (:meth:`~eva0_edge.runtime.data.InputStream.batches`, as ``adapt``
    and ``calibrate`` do). ValueError when no image is left."""
    import numpy as np

    parts: list[np.ndarray] = []
    have = 0
    for _, x, _ in stream.batches(count, skip_bad=True):
        parts.append(x[: count - have])
        have += len(parts[-1])
        if have >= count:
            break
    if not have:
        raise ValueError(f"--calib: no decodable image among its {len(stream)} files"
                         + stream.skipped_summary())
    return np.concatenate(parts)


def _cmd_quantize(args: argparse.Namespace) -> None:
    from eva0_edge.runtime.data import open_input
    from eva0_edge.runtime.modelfile import read_metadata
    from eva0_edge.runtime.progress import progress_bar

    from . import quantize_model

    metadata = read_metadata(args.model)
    stream = open_input(args.calib, metadata.preprocessing)
    if len(stream) < args.calib_images:
        raise ValueError(f"--calib has {len(stream)} images, --calib-images asks for "
                         f"{args.calib_images}")
    calibration = calibration_images(stream, args.calib_images)
    start = time.perf_counter()
    bar = progress_bar(desc="searching scales", unit="layer", quiet=args.quiet)

    def progress(done: int, total: int, layer: str) -> None:
        bar.total = total
        bar.set_postfix_str(layer, refresh=False)
        bar.update(done - bar.n)

    with bar:
        quantized = quantize_model(args.model, args.output, args.bits, calibration, args.scheme,
                                   args.fake_quant, progress)
    q = quantized.quantization
    kind = "fake quant" if args.fake_quant else "integer kernels"
    print(f"wrote {args.output}: {q['scheme']} W{q['bits']}A{q['bits']} ({kind}), calibrated on "
          f"{len(calibration)} images in {time.perf_counter() - start:.0f} s"
          + stream.skipped_summary())


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="post-training quantization (still adaptable)")
    p.add_argument("--model", required=True, help="adaptable .onnx file (float32)")
    p.add_argument("--bits", type=int, required=True, choices=[8, 6])
    p.add_argument("--calib", required=True,
                   help="calibration images: folder, .npy or .npz (the first --calib-images)")
    p.add_argument("--calib-images", type=int_in(1), default=32, help="default 32")
    p.add_argument("--scheme", default="ptq4vit", choices=["ptq4vit", "int8"],
                   help="ptq4vit: PTQ4ViT-like searched scales, written as integer kernels; "
                   "int8: ORT's static min-max quantization (no search). Default ptq4vit")
    p.add_argument("--fake-quant", action="store_true",
                   help="ptq4vit only: write the float simulation (the paper's protocol) "
                   "instead of integer kernels")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="output .onnx path")
    p.set_defaults(func=_cmd_quantize)
