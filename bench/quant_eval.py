"""Quantization benchmark: accuracy of FP32 / W8A8 / W6A6 with NoAdapt and EVA-0, and the speed
of an EVA-0 step on a quantized model against FP32.

    python -m eva0_edge.bench.quant_eval accuracy --model models/vit_fmnist.onnx \\
        --scheme ptq4vit --limit 1000 --out out/quant/vit_fmnist
    python -m eva0_edge.bench.quant_eval speed --arch vit_base_patch16_224 \\
        --batch-sizes 1,8,32 --out out/quant/speed-vitb

``accuracy``: quantizes the model (calibration: 32 clean *train* images, never test; PTQ4ViT both
as integer kernels and as the fake-quant simulation), then runs
NoAdapt and EVA-0 on the clean test images and on the 15 severity-5 corruptions (single-domain
protocol, batch 64, the same seeded subset of ``--limit`` images in each) for every
precision. The integer file against its fake-quant file is a paired comparison: NoAdapt's
prediction of both on the same ``--paired-limit`` images (default all 10000) of every domain,
the gaps with their standard errors from the images exactly one of the two classifies right (at
6 bits either file flips a point or two of a 1000-image domain on its own). Checks the
paper's deployment claim (EVA-0 on the 6-bit model beats NoAdapt on FP32 in average corrupted
accuracy). ``speed``: takes a model file, or exports the architecture with
random weights (cached), quantizes it (PTQ4ViT integer at 8 and 6 bits and fake-quant at 8, and
ORT's static int8 for reference, each in its own process: time and peak RSS), and times an EVA-0
step and a NoAdapt forward on each file at each batch size, interleaved round-robin after
warm-up, medians against FP32 NoAdapt.
Both write a table, JSON and a PNG.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.quant import quantize_model
from eva0_edge.runtime.cache import cache_dir
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8

from .testbed.datasets import Domain, fmnist_c_domains
from .testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from .testbed.machine import environment, process_peak_rss_mb
from .testbed.output import machine_line, pyplot, save_figure, write_outputs
from .testbed.protocols import run_protocol
from .testbed.report import paired_gap
from .testbed.workload import export_random, random_batch

CALIBRATION_IMAGES = 32


def calibration_images(model: str, seed: int = 0) -> np.ndarray:
    """32 clean Fashion-MNIST *train* images (validation images excluded), preprocessed."""
    images, _ = load_fashion_mnist("train")
    train_idx, _ = train_val_indices(len(images))
    pick = np.random.default_rng(seed).choice(train_idx, CALIBRATION_IMAGES, replace=False)
    return preprocess_uint8(images[np.sort(pick)], read_metadata(model).preprocessing)


def _accuracy_runs(path: str, domains: list[Domain], batch: int, threads: int | None) -> dict:
    pre = read_metadata(path).preprocessing
    out = {}
    for method in ("noadapt", "eva0"):
        result = run_protocol(
            method, lambda m=method: Policy.load(path, m, seed=0, provider="cpu",
                                                        threads=threads),
            domains, "single", batch, pre, progress=False,
        )
        clean = result.accuracy.pop("clean")
        out[method] = {"clean": clean, "corrupted_average": result.average,
                       "corrupted": dict(result.accuracy)}
    return out


def _seeded_subset(total: int, limit: int | None) -> np.ndarray | None:
    """Sorted indices of a seeded ``limit``-image subset of ``total``; None for all of them."""
    if not limit or limit >= total:
        return None
    return np.sort(np.random.default_rng(0).choice(total, limit, replace=False))


def _test_domains(indices: np.ndarray | None) -> list[Domain]:
    """Clean and the 15 severity-5 corruptions of the test images ``indices`` (None: all)."""
    images, labels = load_fashion_mnist("test")
    if indices is not None:
        images, labels = images[indices], labels[indices]
    return [Domain("clean", 0, labels, images=images),
            *fmnist_c_domains(5, "test", indices=indices)]


def _noadapt_hits(path: str, domains: list[Domain], batch: int,
                  threads: int | None) -> dict[str, np.ndarray]:
    """Per domain, bool [N]: NoAdapt's hit on each image (the paired comparison's input)."""
    model = Policy.load(path, "noadapt", seed=0, provider="cpu", threads=threads)
    pre = read_metadata(path).preprocessing
    return {d.name: np.concatenate([model.predict(x).argmax(axis=1) == y
                                    for x, y in d.batches(batch, pre)]) for d in domains}


def run_accuracy(
    model: str, scheme: str, bits: list[int], limit: int | None, out_dir: Path,
    batch: int = 64, threads: int | None = None, paired_limit: int | None = None,
) -> dict[str, Any]:
    """Quantize ``model`` at every ``bits`` and measure every precision (see module doc)."""
    total = len(load_fashion_mnist("test")[1])
    domains = _test_domains(_seeded_subset(total, limit))
    calibration = calibration_images(model)
    files = {"fp32": model}
    encodings = (False, True) if scheme == "ptq4vit" else (False,)
    for b in bits:
        for fake in encodings:
            name = f"w{b}a{b}{' fake' if fake else ''}"
            path = out_dir / f"{Path(model).stem}.{scheme}-{name.replace(' ', '-')}.onnx"
            start = time.perf_counter()
            quantize_model(model, path, b, calibration, scheme, fake_quant=fake)
            print(f"quantized {name} in {time.perf_counter() - start:.1f} s -> {path}",
                  flush=True)
            files[name] = str(path)
    env = environment()
    results = {}
    for precision, path in files.items():
        results[precision] = _accuracy_runs(path, domains, batch, threads)
        r = results[precision]
        print(f"{precision}: clean {r['noadapt']['clean']:.2f} / {r['eva0']['clean']:.2f}, "
              f"severity 5 {r['noadapt']['corrupted_average']:.2f} / "
              f"{r['eva0']['corrupted_average']:.2f} (NoAdapt / EVA-0)", flush=True)
    paired_hits = {}
    if len(encodings) == 2:
        paired = _test_domains(_seeded_subset(total, paired_limit))
        paired_hits = {precision: _noadapt_hits(path, paired, batch, threads)
                       for precision, path in files.items() if precision != "fp32"}
    lowest = f"w{min(bits)}a{min(bits)}"
    return {
        "integer_vs_fake": _integer_vs_fake(results, paired_hits, bits) if paired_hits else {},
        "model": Path(model).name, "scheme": scheme, "limit": limit,
        "paired_images": min(paired_limit or total, total), "batch": batch,
        "protocol": "single", "severity": 5, "calibration_images": CALIBRATION_IMAGES,
        "environment_start": env, "environment_end": environment(), "results": results,
        "claim": {
            "text": f"EVA-0 on {lowest} beats NoAdapt on fp32 (severity-5 average)",
            "eva0_lowest": results[lowest]["eva0"]["corrupted_average"],
            "noadapt_fp32": results["fp32"]["noadapt"]["corrupted_average"],
            "holds": results[lowest]["eva0"]["corrupted_average"]
            > results["fp32"]["noadapt"]["corrupted_average"],
        },
    }


def _integer_vs_fake(results: dict, hits: dict[str, dict[str, np.ndarray]],
                     bits: list[int]) -> dict[str, dict[str, float]]:
    """Per width, from the paired NoAdapt hits: integer minus fake-quant accuracy on clean and
    averaged over the corruptions, each with its standard error (points); from the protocol
    runs: EVA-0's gain over NoAdapt (severity-5 average) on each file."""
    out = {}
    for b in bits:
        integer, fake = hits[f"w{b}a{b}"], hits[f"w{b}a{b} fake"]
        clean = paired_gap(integer["clean"], fake["clean"])
        corrupted = [paired_gap(integer[d], fake[d]) for d in integer if d != "clean"]

        def gain(r: dict) -> float:
            return r["eva0"]["corrupted_average"] - r["noadapt"]["corrupted_average"]

        out[f"w{b}a{b}"] = {
            "clean_gap": clean[0], "clean_gap_se": clean[1],
            "clean_only_integer_right": clean[2], "clean_only_fake_right": clean[3],
            "corrupted_gap": float(np.mean([g[0] for g in corrupted])),
            "corrupted_gap_se": float(np.sqrt(sum(g[1] ** 2 for g in corrupted))
                                      / len(corrupted)),
            "eva0_gain_integer": gain(results[f"w{b}a{b}"]),
            "eva0_gain_fake": gain(results[f"w{b}a{b} fake"]),
        }
    return out


def accuracy_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Quantized accuracy: {report['model']} ({report['scheme']})",
        "",
        f"Clean test and severity-5 Fashion-MNIST-C (single-domain, batch {report['batch']}, "
        f"{report['limit'] or 'all'} images per domain); calibration: "
        f"{report['calibration_images']} clean train images.",
        "",
        "| precision | clean NoAdapt | clean EVA-0 | sev-5 NoAdapt | sev-5 EVA-0 |",
        "|---|---|---|---|---|",
    ]
    for precision, r in report["results"].items():
        lines.append(
            f"| {precision} | {r['noadapt']['clean']:.2f} | {r['eva0']['clean']:.2f} | "
            f"{r['noadapt']['corrupted_average']:.2f} | {r['eva0']['corrupted_average']:.2f} |"
        )
    if report.get("integer_vs_fake"):
        lines += ["", f"Integer against fake-quant: NoAdapt on the same {report['paired_images']} "
                  "images of every domain (standard error in brackets).", "",
                  "| width | integer - fake, clean | clean images only integer / only fake "
                  "right | integer - fake, sev-5 | EVA-0 gain integer | EVA-0 gain fake |",
                  "|---|---|---|---|---|---|"]
        for width, g in report["integer_vs_fake"].items():
            lines.append(f"| {width} | {g['clean_gap']:+.2f} ({g['clean_gap_se']:.2f}) | "
                         f"{g['clean_only_integer_right']} / {g['clean_only_fake_right']} | "
                         f"{g['corrupted_gap']:+.2f} ({g['corrupted_gap_se']:.2f}) | "
                         f"{g['eva0_gain_integer']:+.2f} | {g['eva0_gain_fake']:+.2f} |")
    claim = report["claim"]
    lines += ["", f"{claim['text']}: {claim['eva0_lowest']:.2f} vs {claim['noadapt_fp32']:.2f} "
              f"-> {'holds' if claim['holds'] else 'does not hold'}"]
    return "\n".join(lines) + "\n"


SPEED_FILES = (  # (name, scheme, bits, fake_quant)
    ("ptq4vit w8a8", "ptq4vit", 8, False),
    ("ptq4vit w6a6", "ptq4vit", 6, False),
    ("ptq4vit w8a8 fake", "ptq4vit", 8, True),
    ("int8 w8a8", "int8", 8, False),  # ORT's static min-max quantization, no search
)


def _quantize_measured(fp32: str, path: str, bits: int, calibration_path: str, scheme: str,
                       fake: bool) -> dict[str, float]:
    """Quantize in this (fresh) process; its wall time (s) and its own peak RSS (MiB)."""
    start = time.perf_counter()
    quantize_model(fp32, path, bits, np.load(calibration_path), scheme, fake_quant=fake)
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": process_peak_rss_mb()}


def run_speed(
    model: str | None, arch: str | None, batches: list[int], repeats: int, warmup: int,
    threads: int | None, out_dir: Path,
) -> dict[str, Any]:
    """Quantize ``model`` (calibrated on clean train images) or ``arch`` with random weights
    (calibrated on random images) into every SPEED_FILES entry, each in its own process (time
    and peak RSS), then time NoAdapt forwards and EVA-0 steps on every file at every batch size,
    interleaved round-robin after warm-up; medians, and ratios to FP32 NoAdapt."""
    if model:
        fp32, calibration = model, calibration_images(model)
    else:
        fp32 = str(export_random(arch, cache_dir() / "bench-models"))
        calibration = random_batch(read_metadata(fp32), CALIBRATION_IMAGES, seed=1)
    metadata = read_metadata(fp32)
    calibration_path = out_dir / "calibration.npy"
    np.save(calibration_path, calibration)
    stem = Path(fp32).stem
    files = {"fp32": fp32}
    quantize_cost = {}
    spawn = multiprocessing.get_context("spawn")
    for name, scheme, bits, fake in SPEED_FILES:
        path = out_dir / f"{stem}.{name.replace(' ', '-')}.onnx"
        with spawn.Pool(1) as pool:
            quantize_cost[name] = pool.apply(_quantize_measured, (
                fp32, str(path), bits, str(calibration_path), scheme, fake))
        print(f"quantized {name} in {quantize_cost[name]['seconds']:.0f} s, peak RSS "
              f"{quantize_cost[name]['peak_rss_mib']:.0f} MiB", flush=True)
        files[name] = str(path)
    sizes = {name: Path(path).stat().st_size / 2**20 for name, path in files.items()}
    models = {(name, method): Policy.load(path, method, seed=0, provider="cpu",
                                                 threads=threads)
              for name, path in files.items() for method in ("noadapt", "eva0")}
    env = environment()
    rows = []
    for batch in batches:
        x = random_batch(metadata, batch)
        for model_ in models.values():
            for _ in range(warmup):
                model_.step(x)
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in models}
        for _ in range(repeats):
            for key, model_ in models.items():
                start = time.perf_counter()
                model_.step(x)
                samples[key].append(1000 * (time.perf_counter() - start) / batch)
        base = float(np.median(samples[("fp32", "noadapt")]))
        for (name, method), times in samples.items():
            median = float(np.median(times))
            rows.append({"precision": name, "method": method, "batch": batch,
                         "ms_per_sample": median, "vs_fp32_noadapt": median / base,
                         "samples_ms": times})
        print(f"batch {batch}: " + ", ".join(
            f"{r['precision']} {r['method']} {r['vs_fp32_noadapt']:.2f}x"
            for r in rows if r["batch"] == batch), flush=True)
    return {"architecture": metadata.architecture, "model": Path(fp32).name, "batches": batches,
            "repeats": repeats, "warmup": warmup, "threads": threads or "ort default",
            "size_mib": sizes, "quantize": quantize_cost, "environment_start": env,
            "environment_end": environment(), "rows": rows}


def speed_markdown(report: dict[str, Any]) -> str:
    names = list(report["size_mib"])
    lines = [
        f"## Quantized speed: {report['architecture']} ({report['model']})",
        "",
        machine_line(report),
        "",
        "Time per sample relative to FP32 NoAdapt at the same batch size.",
        "",
        "| file | size MiB | quantize s | quantize peak RSS MiB | "
        + " | ".join(f"NoAdapt B={b} | EVA-0 B={b}" for b in report["batches"]) + " |",
        "|---|---|---|---|" + "---|---|" * len(report["batches"]),
    ]
    for name in names:
        cost = report["quantize"].get(name)
        cells = [f"{report['size_mib'][name]:.1f}",
                 f"{cost['seconds']:.0f}" if cost else "-",
                 f"{cost['peak_rss_mib']:.0f}" if cost else "-"]
        for b in report["batches"]:
            for method in ("noadapt", "eva0"):
                r = next(r for r in report["rows"] if r["precision"] == name
                         and r["method"] == method and r["batch"] == b)
                cells.append(f"{r['vs_fp32_noadapt']:.2f}x ({r['ms_per_sample']:.1f} ms)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot_accuracy(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    precisions = list(report["results"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("clean", "corrupted_average"), strict=True):
        for offset, method in ((-0.2, "noadapt"), (0.2, "eva0")):
            values = [report["results"][p][method][key] for p in precisions]
            ax.bar(np.arange(len(precisions)) + offset, values, 0.4, label=method)
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set_title("clean" if key == "clean" else "severity 5 (average of 15)")
        ax.set_ylabel("accuracy %")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: {report['scheme']}")
    save_figure(fig, path)


def _plot_speed(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    batches = report["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 4), squeeze=False)
    precisions = list(report["size_mib"])
    for ax, batch in zip(axes[0], batches, strict=True):
        for offset, method in ((-0.2, "noadapt"), (0.2, "eva0")):
            values = [next(r["vs_fp32_noadapt"] for r in report["rows"] if r["precision"] == p
                           and r["method"] == method and r["batch"] == batch)
                      for p in precisions]
            ax.bar(np.arange(len(precisions)) + offset, values, 0.4, label=method)
        ax.set_xticks(range(len(precisions)), precisions, rotation=30, fontsize=7)
        ax.set_ylabel("time / FP32 NoAdapt")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=8)
    fig.suptitle(report["architecture"])
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("accuracy")
    p.add_argument("--model", required=True)
    p.add_argument("--scheme", default="ptq4vit", choices=["ptq4vit", "int8"])
    p.add_argument("--bits", default="8,6")
    p.add_argument("--limit", type=int, default=1000, help="images per corrupted domain")
    p.add_argument("--paired-limit", type=int,
                   help="images per domain of the integer / fake-quant paired comparison "
                   "(default: all 10000)")
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True)
    p = sub.add_parser("speed")
    p.add_argument("--model", help="adaptable .onnx file (default: --arch, random weights)")
    p.add_argument("--arch", default="vit_base_patch16_224")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "accuracy":
        report = run_accuracy(args.model, args.scheme, [int(b) for b in args.bits.split(",")],
                              args.limit, out, threads=args.threads,
                              paired_limit=args.paired_limit)
        text = accuracy_markdown(report)
        print(text)
        write_outputs(out, "quant_accuracy", report, text, _plot_accuracy)
        print(f"report: {out}/quant_accuracy.md, .json, .png")
    else:
        report = run_speed(args.model, args.arch, [int(b) for b in args.batch_sizes.split(",")],
                           args.repeats, args.warmup, args.threads, out)
        text = speed_markdown(report)
        print(text)
        write_outputs(out, "quant_speed", report, text, _plot_speed)
        print(f"report: {out}/quant_speed.md, .json, .png")


if __name__ == "__main__":
    main()
