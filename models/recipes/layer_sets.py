"""Recipe: a shipped model re-exported adapting fewer stages or blocks, for the accuracy half
of "where to adapt" (the cost half is ``make layers`` on ResNet50-GN and ViT-B).

    python models/recipes/layer_sets.py --adapt 4 --adapt 3-4 --out out/layers
    python models/recipes/layer_sets.py --arch vit_fmnist --adapt 5-7 --adapt 4-7 --out out/layers

For each ``--adapt`` set: the shipped weights (``models/<arch>.pth``) exported with that set,
calibrated on the same training images with the same seed as the shipped file, and given the
shipped file's recommended and tuned values (guard bounds, shift bound, rates), so the file
differs from the shipped one in what it adapts only. Tune its rates by the rule with
``python models/recipes/tune.py --model out/layers/<arch>-<set>.onnx --method eva0 --write`` before
comparing it with the shipped file's own set re-exported and tuned the same way (the ResNet-GN
ships adapting stages 1-3 of 1-4, the ViT blocks 1-6 of 0-7: the exporter's defaults).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eva0_edge.bench.testbed.fashion_mnist import (
    CALIBRATION_IMAGES,
    CLASS_NAMES,
    load_fashion_mnist,
    train_val_indices,
)
from eva0_edge.bench.testbed.testbed_archs import ARCHS
from eva0_edge.exporter import export_model
from eva0_edge.runtime.calibrate import calibrate_with_images
from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

MODELS_DIR = Path(__file__).resolve().parents[1]


def export_layer_set(arch: str, adapt: str, out_dir: Path) -> Path:
    """The shipped ``arch`` adapting the stages or blocks ``adapt`` names, at ``out_dir``."""
    log = json.loads((MODELS_DIR / f"{arch}.train.json").read_text())
    model = ARCHS[arch]()
    model.load_state_dict(torch.load(MODELS_DIR / f"{arch}.pth", map_location="cpu"))
    model.eval()
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    out = out_dir / f"{arch}-{adapt}.onnx"
    pre = Preprocessing((3, 32, 32), (log["mean"],) * 3, (log["std"],) * 3, "bilinear", 1.0)
    export_model(arch, out, model=model, adapt=adapt, labels=CLASS_NAMES, preprocessing=pre)
    calibrate_with_images(out, images[train_idx], CALIBRATION_IMAGES, log["seed"])
    shipped = read_metadata(MODELS_DIR / f"{arch}.onnx")
    onnx_model = load_onnx(out)
    metadata = read_metadata(onnx_model)
    metadata.recommended, metadata.tuned = dict(shipped.recommended), dict(shipped.tuned)
    save_onnx(set_metadata(onnx_model, metadata), out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="resnet_gn_fmnist",
                        help="the shipped model to re-export")
    parser.add_argument("--adapt", action="append", required=True,
                        help="stages or blocks to adapt, e.g. 4 or 3-4 (repeatable)")
    parser.add_argument("--out", default="out/layers", help="folder for the files")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for adapt in args.adapt:
        path = export_layer_set(args.arch, adapt, out_dir)
        metadata = read_metadata(path)
        print(f"{path}: adapts {metadata.adapt}, theta [{metadata.num_params}]")


if __name__ == "__main__":
    main()
