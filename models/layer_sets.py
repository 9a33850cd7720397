"""Recipe: the shipped ResNet-GN re-exported adapting fewer stages, for the accuracy half of
"where to adapt" (the cost half is ``make layers`` on ResNet50-GN).

    python models/layer_sets.py --adapt 3 --adapt 2-3 --out out/layers

For each ``--adapt`` set: the shipped weights (``models/resnet_gn_fmnist.pth``) exported with
that set, calibrated on the same training images with the same seed as the shipped file, and
given the shipped file's recommended and tuned values (guard bounds, shift bound, rates), so
the file differs from the shipped one in what it adapts only. Tune its rates by the rule with
``python models/tune.py --model out/layers/resnet_gn_fmnist-<set>.onnx --method eva0 --write``
before comparing it with the shipped file (which adapts stages 1-3, every GroupNorm).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eva0_edge.bench.fashion_mnist import (
    CALIBRATION_IMAGES,
    CLASS_NAMES,
    load_fashion_mnist,
    train_val_indices,
)
from eva0_edge.bench.testbed_archs import ARCHS
from eva0_edge.exporter import export_model
from eva0_edge.runtime.calibrate import calibrate_with_images
from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

MODELS_DIR = Path(__file__).resolve().parent
ARCH = "resnet_gn_fmnist"


def export_layer_set(adapt: str, out_dir: Path) -> Path:
    """The shipped ResNet-GN adapting the stages ``adapt`` names, at ``out_dir``."""
    log = json.loads((MODELS_DIR / f"{ARCH}.train.json").read_text())
    model = ARCHS[ARCH]()
    model.load_state_dict(torch.load(MODELS_DIR / f"{ARCH}.pth", map_location="cpu"))
    model.eval()
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    out = out_dir / f"{ARCH}-{adapt}.onnx"
    pre = Preprocessing((3, 32, 32), (log["mean"],) * 3, (log["std"],) * 3, "bilinear", 1.0)
    export_model(ARCH, out, model=model, adapt=adapt, labels=CLASS_NAMES, preprocessing=pre)
    calibrate_with_images(out, images[train_idx], CALIBRATION_IMAGES, log["seed"])
    shipped = read_metadata(MODELS_DIR / f"{ARCH}.onnx")
    onnx_model = load_onnx(out)
    metadata = read_metadata(onnx_model)
    metadata.recommended, metadata.tuned = dict(shipped.recommended), dict(shipped.tuned)
    save_onnx(set_metadata(onnx_model, metadata), out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapt", action="append", required=True,
                        help="stages to adapt, e.g. 3 or 2-3 (repeatable)")
    parser.add_argument("--out", default="out/layers", help="folder for the files")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for adapt in args.adapt:
        path = export_layer_set(adapt, out_dir)
        metadata = read_metadata(path)
        print(f"{path}: adapts {metadata.adapt}, theta [{metadata.num_params}]")


if __name__ == "__main__":
    main()
