"""Recipe: train a small source model on clean Fashion-MNIST (32x32 RGB) on the CPU, export it
as an adaptable ONNX model with source feature statistics, and log what happened.

    python models/recipes/train.py --arch vit_fmnist --epochs 11 --no-flip --compile --seed 0
    python models/recipes/train.py --arch resnet_gn_fmnist --epochs 6 --seed 0
    python models/recipes/train.py --arch mobilenet_bn_fmnist --epochs 6 --lr 1e-2 --channels-last \
        --threads 1 --seed 0 --no-export    # 91.16% clean, 12.6 min on one core (taskset -c 1)

Training uses the train split minus the 5000 held-out validation images
(``bench.testbed.fashion_mnist.train_val_indices``); the test split is only used for the final clean
accuracy. Output: ``models/<arch>.onnx`` (the adaptable model), ``models/<arch>.pth`` (the torch
state dict, for the backprop baselines) and ``models/<arch>.train.json`` (the training log);
``--no-export`` writes the state dict and the log only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from eva0_edge.bench.testbed.fashion_mnist import (
    CALIBRATION_IMAGES,
    CLASS_NAMES,
    load_fashion_mnist,
    train_val_indices,
)
from eva0_edge.bench.testbed.testbed_archs import ARCHS
from eva0_edge.runtime.cache import cache_dir

MODELS_DIR = Path(__file__).resolve().parents[1]


def to_tensor(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """uint8 [N, H, W, C] -> normalised float [N, C, H, W]."""
    x = torch.tensor(images).permute(0, 3, 1, 2).float().div_(255.0)
    return (x - mean) / std


def augment(x: torch.Tensor, generator: torch.Generator, flip: bool) -> torch.Tensor:
    """Random 2-pixel shifts (background padding) and, if ``flip``, horizontal flips."""
    n = x.shape[0]
    padded = F.pad(x, (2, 2, 2, 2), value=float(x.min()))
    shifts = torch.randint(0, 5, (n, 2), generator=generator)
    flips = (torch.rand(n, generator=generator) < 0.5) & flip
    out = torch.empty_like(x)
    for i in range(n):
        dy, dx = int(shifts[i, 0]), int(shifts[i, 1])
        crop = padded[i, :, dy : dy + 32, dx : dx + 32]
        out[i] = crop.flip(-1) if flips[i] else crop
    return out


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    model.eval()
    correct = sum(
        int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
        for i in range(0, len(x), batch)
    )
    return 100.0 * correct / len(x)


def compiled_for_training(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` the model (a view sharing its parameters) for the training steps.

    Attention runs as plain matmul + softmax: at 65 tokens and head width 32, PyTorch's fused
    CPU flash-attention kernel is slower than the three small matmuls. On this CPU (2 cores) a
    ViT training step at batch 128 takes 0.86x the eager step's time with both changes.
    """
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
    return torch.compile(model)


def train(
    arch: str, epochs: int, seed: int, batch_size: int, lr: float, device: str = "cpu",
    flip: bool = True, compile_model: bool = False, channels_last: bool = False,
    threads: int | None = None,
) -> dict:
    torch.manual_seed(seed)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    generator = torch.Generator().manual_seed(seed)
    images, labels = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    mean = float(images[train_idx].mean() / 255.0)
    std = float(images[train_idx].std() / 255.0)
    x_train = to_tensor(images[train_idx], mean, std)
    y_train = torch.from_numpy(labels[train_idx])
    test_images, test_labels = load_fashion_mnist("test")
    x_test, y_test = to_tensor(test_images, mean, std), torch.from_numpy(test_labels)

    model = ARCHS[arch]().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    train_model = compiled_for_training(model) if compile_model else model
    x_test, y_test = x_test.to(device), y_test.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = len(x_train) // batch_size
    total = epochs * steps_per_epoch
    warmup = min(300, total // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup
        else 0.5 * (1 + np.cos(np.pi * (s - warmup) / max(1, total - warmup))),
    )
    log = {"arch": arch, "seed": seed, "epochs": [], "batch_size": batch_size, "lr": lr,
           "flip": flip, "compile": compile_model, "device": device,
           **({"channels_last": True} if channels_last else {}),
           "load_average_start": os.getloadavg(), "threads": torch.get_num_threads()}
    start = time.time()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        epoch_start = time.time()
        bar = tqdm(range(steps_per_epoch), desc=f"{arch} epoch {epoch + 1}/{epochs}")
        losses = []
        for step in bar:
            idx = order[step * batch_size : (step + 1) * batch_size]
            batch = augment(x_train[idx], generator, flip).to(device)
            if channels_last:
                batch = batch.contiguous(memory_format=torch.channels_last)
            logits = train_model(batch)
            loss = F.cross_entropy(logits, y_train[idx].to(device), label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        log["epochs"].append({"epoch": epoch + 1, "seconds": time.time() - epoch_start,
                              "train_loss": float(torch.stack(losses).mean())})
    log["train_seconds"] = time.time() - start
    log["clean_test_accuracy"] = accuracy(model, x_test, y_test)
    print(f"clean test accuracy {log['clean_test_accuracy']:.2f}%", flush=True)
    log["load_average_end"] = os.getloadavg()
    log["mean"], log["std"] = mean, std
    checkpoint = cache_dir() / "checkpoints" / f"{arch}.pth"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    model = model.cpu()
    if channels_last:
        model = model.to(memory_format=torch.contiguous_format)
    torch.save(model.state_dict(), checkpoint)
    shutil.copyfile(checkpoint, MODELS_DIR / f"{arch}.pth")
    return log, model, images[train_idx]


def export_and_calibrate(arch: str, model: torch.nn.Module, log: dict, clean: np.ndarray) -> Path:
    # imported here so that --no-export needs neither the exporter nor the calibration
    from eva0_edge.exporter import export_model
    from eva0_edge.runtime.calibrate import calibrate_with_images
    from eva0_edge.runtime.metadata import Preprocessing

    out = MODELS_DIR / f"{arch}.onnx"
    pre = Preprocessing((3, 32, 32), (log["mean"],) * 3, (log["std"],) * 3, "bilinear", 1.0)
    export_model(arch, out, model=model, labels=CLASS_NAMES, preprocessing=pre)
    return calibrate_with_images(out, clean, CALIBRATION_IMAGES, log["seed"])


def export_trained(arch: str) -> None:
    """``--export-only``: the shipped state dict and training log -> the adaptable file."""
    log = json.loads((MODELS_DIR / f"{arch}.train.json").read_text())
    model = ARCHS[arch]()
    model.load_state_dict(torch.load(MODELS_DIR / f"{arch}.pth", map_location="cpu",
                                     weights_only=True))
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    out = export_and_calibrate(arch, model.eval(), log, images[train_idx])
    log["onnx"], log["onnx_bytes"] = out.name, out.stat().st_size
    (MODELS_DIR / f"{arch}.train.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"{arch}: -> {out} ({log['onnx_bytes'] / 1e6:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default="cpu", help="torch device (the recipe is CPU)")
    parser.add_argument("--no-flip", action="store_true", help="shifts only (the ViT recipe)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training steps (the ViT recipe)")
    parser.add_argument("--channels-last", action="store_true",
                        help="train in channels-last memory format (the MobileNet recipe: "
                        "depthwise convolutions ~2x faster on the CPU); saved contiguous")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: os.cpu_count())")
    parser.add_argument("--no-export", action="store_true",
                        help="train, write the state dict and the log only (no ONNX file)")
    parser.add_argument("--export-only", action="store_true",
                        help="no training: export and calibrate models/<arch>.pth with the "
                        "normalisation its models/<arch>.train.json recorded")
    args = parser.parse_args()
    if args.export_only:
        export_trained(args.arch)
        return
    log, model, clean = train(
        args.arch, args.epochs, args.seed, args.batch_size, args.lr, args.device, not args.no_flip,
        args.compile, args.channels_last, args.threads,
    )
    if args.no_export:
        (MODELS_DIR / f"{args.arch}.train.json").write_text(json.dumps(log, indent=2) + "\n")
        print(json.dumps(log["epochs"]))
        print(f"{args.arch}: {log['clean_test_accuracy']:.2f}% clean test accuracy, "
              f"{log['train_seconds'] / 60:.1f} min, -> {MODELS_DIR / (args.arch + '.pth')}")
        return
    out = export_and_calibrate(args.arch, model, log, clean)
    log["onnx"] = out.name
    log["onnx_bytes"] = out.stat().st_size
    (MODELS_DIR / f"{args.arch}.train.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"{args.arch}: {log['clean_test_accuracy']:.2f}% clean test accuracy, "
          f"{log['train_seconds'] / 60:.1f} min, -> {out} ({log['onnx_bytes'] / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
