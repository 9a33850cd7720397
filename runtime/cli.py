"""The ``eva0-edge`` command line.

Subcommands that need torch (``export``) import it lazily, so the device subcommands run on an
install without torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from .config import parse_key_values
from .metadata import ModelFormatError
from .session import InputError
from .state import StateError

log = logging.getLogger("eva0_edge")

IO_BINDING_HELP = (
    "run ORT through IOBinding: outputs into buffers reused from step to step (on CUDA the "
    "inputs into reused device buffers)"
)
LOW_MEMORY_HELP = (
    "run the +/- copies as two ORT calls: peak memory of plain inference, the shared prefix "
    "computed twice"
)


def _missing_extra(command: str, extra: str, err: ImportError) -> SystemExit:
    """The exit for a subcommand whose optional dependencies are not installed."""
    return SystemExit(
        f"{command} needs the [{extra}] extra: pip install 'eva0-edge[{extra}]' ({err})"
    )


def _cmd_export(args: argparse.Namespace) -> None:
    try:
        from eva0_edge.exporter import export_model
    except ImportError as err:
        raise _missing_extra("export", "export", err) from err
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


def _cmd_info(args: argparse.Namespace) -> None:
    from .info import describe
    from .modelfile import read_metadata

    print(describe(read_metadata(args.model), full=args.full))


def _cmd_calibrate(args: argparse.Namespace) -> None:
    from .calibrate import feature_statistics, write_source_stats
    from .data import open_input
    from .modelfile import read_metadata
    from .session import AdaptableSession

    metadata = read_metadata(args.model)
    session = AdaptableSession(args.model, metadata, args.provider)
    stream = open_input(args.data, metadata.preprocessing)
    mean, std = feature_statistics(session, stream, args.batch_size, progress=not args.quiet)
    write_source_stats(args.model, args.output, mean, std)
    print(f"wrote {args.output}: source statistics of {metadata.num_features} features "
          f"from {len(stream)} images")


def _cmd_quantize(args: argparse.Namespace) -> None:
    from eva0_edge.quant import quantize_model

    from .data import open_input
    from .modelfile import read_metadata

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


def _cmd_adapt(args: argparse.Namespace) -> None:
    from pathlib import Path

    from tqdm import tqdm

    from .data import open_input
    from .foa import FOAModel
    from .methods import load_method
    from .predictions import PredictionWriter

    model = load_method(
        args.model, args.method, parse_key_values(args.set or []), args.seed, args.provider,
        low_memory=args.low_memory, io_binding=args.io_binding,
    )
    if args.state and isinstance(model, FOAModel):
        raise ValueError(
            f"--state: {args.method}'s CMA-ES search state cannot be saved or resumed yet; "
            "run it without --state"
        )
    if args.state and Path(args.state).is_file():
        model.load_state(args.state)
        log.info("resumed from %s at step %d", args.state, model.state.step)
    stream = open_input(args.input, model.metadata.preprocessing)
    correct = seen = 0
    with PredictionWriter(args.output, model.metadata.labels, args.logits) as writer:
        progress = tqdm(
            stream.batches(args.batch_size),
            total=-(-len(stream) // args.batch_size),
            desc=args.method,
            disable=True if args.quiet else None,  # None: off when not a terminal
        )
        for names, x, labels in progress:
            logits = model.step(x)
            writer.write(names, logits, labels)
            if labels is not None:
                correct += int((logits.argmax(axis=1) == labels).sum())
                seen += len(labels)
                progress.set_postfix(acc=f"{100.0 * correct / seen:.2f}")
    if args.state:
        model.save_state(args.state)
    stats = model.stats()
    summary = (
        f"{args.method}: {stats['samples']} samples, {stats['steps']} steps "
        f"({stats['skipped_steps']} skipped), {stats['forwards_per_sample']:.2f} forwards/sample, "
        f"drift {stats['drift']:.4g}"
    )
    if seen:
        summary += f", accuracy {100.0 * correct / seen:.2f}%"
    print(summary + f" -> {args.output}")


def _cmd_eval(args: argparse.Namespace) -> None:
    try:
        from eva0_edge.bench.evaluate import EvalSpec, evaluate
        from eva0_edge.bench.report import markdown_table
    except ImportError as err:
        raise _missing_extra("eval", "bench", err) from err
    spec = EvalSpec(
        model=args.model,
        dataset=args.dataset,
        protocol=args.protocol,
        severity=args.severity,
        batch_size=args.batch_size,
        methods=_names(args.methods),
        batch_sizes=[int(b) for b in _names(args.batch_sizes)] if args.batch_sizes else None,
        corruptions=_names(args.corruptions) if args.corruptions else None,
        seed=args.seed,
        limit=args.limit,
        split=args.split,
        overrides=parse_key_values(args.set or []),
        torch_checkpoint=args.torch_checkpoint,
        provider=args.provider,
        io_binding=args.io_binding,
        threads=args.threads,
        prompt_model=args.prompt_model,
    )
    results = evaluate(spec, args.out, progress=not args.quiet)
    print(markdown_table(results))
    for name, result in results.items():
        if result.skipped_steps:
            print(f"{name}: {result.skipped_steps} adaptation steps skipped (non-finite)")
    if args.out:
        print(f"report: {args.out}/results.md, results.json, stream.png")


def _names(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _cmd_bench(args: argparse.Namespace) -> None:
    from pathlib import Path

    try:
        from eva0_edge.bench.cache import cache_dir
        from eva0_edge.bench.cost import bench_prompt_model, markdown, run_bench, write_outputs
        from eva0_edge.bench.workload import export_random
    except ImportError as err:
        raise _missing_extra("bench", "bench", err) from err
    if bool(args.model) == bool(args.arch):
        raise ValueError("give exactly one of --model FILE or --arch TIMM_NAME")
    torch_spec = {"checkpoint": args.torch_checkpoint}
    model = args.model
    if args.arch:
        model = str(export_random(args.arch, cache_dir() / "bench-models", args.seed))
        torch_spec = {"arch": args.arch, "seed": args.seed}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    report = run_bench(
        model,
        [int(b) for b in args.batch_sizes.split(",")],
        methods,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        memory=not args.no_memory,
        torch_spec=torch_spec,
        progress=not args.quiet,
        prompt_model=bench_prompt_model(model, args.arch, args.seed, args.prompt_model, methods),
        provider=args.provider,
    )
    print(markdown(report))
    if args.out:
        write_outputs(report, Path(args.out))
        print(f"report: {args.out}/cost.md, cost.json, cost.png")


def _cmd_serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .engine import AdaptiveModel
    from .server import ServeOptions, run_server

    model = AdaptiveModel.load(
        args.model, args.method, parse_key_values(args.set or []), args.seed, args.provider,
        args.threads, args.low_memory, args.io_binding,
    )
    options = ServeOptions(
        name=args.name or Path(args.model).stem,
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        adaptive_delay=not args.fixed_delay,
        state_dir=args.state_dir,
        snapshot_every=args.snapshot_every,
        keep_snapshots=args.keep_snapshots,
        max_body_mb=args.max_body_mb,
        summary_every_s=args.summary_every,
        max_pixels_mp=args.max_pixels_mp,
        admin_token=args.admin_token or os.environ.get("EVA0_ADMIN_TOKEN") or None,
        loopback=_is_loopback(args.host),
        header_timeout_s=args.header_timeout_s,
    )
    if options.max_pixels_mp <= 0 or options.header_timeout_s <= 0:
        raise ValueError("need --max-pixels-mp > 0 and --header-timeout-s > 0")
    if options.max_batch < 1 or options.max_delay_ms < 0 or options.snapshot_every < 1:
        raise ValueError("need --max-batch >= 1, --max-delay-ms >= 0, --snapshot-every >= 1")
    level = "debug" if args.verbose >= 2 else "info"
    run_server(model, options, args.host, args.port, level)


def _is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _add_runtime_options(p: argparse.ArgumentParser, *, method: bool = True) -> None:
    """Options that mean the same in every subcommand."""
    if method:
        p.add_argument("--seed", type=int, default=0, help="perturbation seed (default 0)")
        p.add_argument(
            "--set", action="append", metavar="KEY=VALUE",
            help="hyper-parameter override, repeatable: --set eta=0.001 --set lambda_swa=0",
        )
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    if method:
        p.add_argument("--io-binding", action="store_true", help=IO_BINDING_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _runtime_method(name: str) -> str:
    """argparse type of --method on adapt: any runtime method (FOA included), @FP allowed."""
    from .methods import base_name

    try:
        base_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return name


def _engine_method(name: str) -> str:
    """argparse type of --method on adapt / serve: an EVA-0-family method, @FP allowed."""
    from .engine import METHODS, parse_method

    try:
        base, _ = parse_method(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if base not in METHODS:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not one of {', '.join(sorted(METHODS))} (FOA runs in adapt, eval "
            "and bench; the server keeps EVA-0-family state only)"
        )
    return name


METHOD_HELP = ("noadapt, eva0 (default), eva0-dagger, zoa, spsa2-shared or eva0-clubs (prompt "
               "models); name@FP sets the forwards per sample, e.g. eva0-clubs@8")
ADAPT_METHOD_HELP = METHOD_HELP.replace(
    "eva0-clubs (prompt models)", "eva0-clubs / foa / foa-dagger (prompt models)"
)


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
    p.add_argument("--prompts", type=int, default=0, metavar="T",
                   help="ViT black-box prompt mode: T prompt tokens after CLS as the only "
                   "adaptable input, weights frozen (for foa / foa-dagger / eva0-clubs)")
    p.add_argument("--prompt-seed", type=int, default=0, help="initial prompt seed (default 0)")
    p.add_argument("-o", "--output", required=True, help="output .onnx path")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("info", help="print an adaptable model's metadata")
    p.add_argument("model", help="adaptable .onnx file")
    p.add_argument("--full", action="store_true", help="list every theta segment")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("calibrate", help="add source feature statistics from clean images")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--data", required=True, help="clean images: folder, .npy or .npz")
    p.add_argument("-o", "--output", required=True, help="output .onnx (may equal --model)")
    _add_runtime_options(p, method=False)
    p.set_defaults(func=_cmd_calibrate)

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

    p = sub.add_parser("adapt", help="predict and adapt over an offline stream")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--input", required=True, help="folder of images, .npy or .npz (the stream)")
    p.add_argument("--output", required=True, help="predictions .jsonl or .csv")
    p.add_argument("--logits", action="store_true", help="also write the logits")
    p.add_argument("--method", default="eva0", type=_runtime_method, help=ADAPT_METHOD_HELP)
    p.add_argument("--state", help="state file: resumed from if it exists, saved at the end")
    p.add_argument("--low-memory", action="store_true", help=LOW_MEMORY_HELP)
    _add_runtime_options(p)
    p.set_defaults(func=_cmd_adapt)

    p = sub.add_parser("eval", help="accuracy of methods under a protocol on corrupted data")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument(
        "--dataset", default="fmnist-c",
        help="fmnist-c (generated into the cache) or an ImageNet-C-style folder "
        "corruption/severity/class/image",
    )
    p.add_argument("--protocol", default="single",
                   choices=["single", "continual", "imbalanced", "soak"],
                   help="soak: the continual stream 10 times in a row")
    p.add_argument("--severity", type=int, default=5, choices=[1, 2, 3, 4, 5])
    p.add_argument("--methods", default="noadapt,eva0", help="comma-separated; runtime methods "
                   "(name@FP sets #FP, e.g. eva0-clubs@8, foa-dagger@14) plus the torch "
                   "baselines tent, sar, deyo")
    p.add_argument("--limit", type=int, help="images per corruption (a seeded subset)")
    p.add_argument("--batch-sizes", help="comma-separated: one run per batch size in one "
                   "report (a row per method and batch size); overrides --batch-size")
    p.add_argument("--corruptions", help="comma-separated domains (default: all 15); 'clean' "
                   "is the uncorrupted images; hostile streams: black, white, repeat, noise, "
                   "burst, alternate (e.g. --protocol continual --corruptions black,clean)")
    p.add_argument("--split", default="test", choices=["test", "val"],
                   help="fmnist-c: test, or val (held-out train images, for tuning)")
    p.add_argument("--torch-checkpoint", help="torch weights for tent/sar/deyo on a non-shipped "
                   "model")
    p.add_argument("--out", help="folder for results.md / results.json / stream.png")
    p.add_argument("--threads", type=int, help="intra-op threads of ORT and torch")
    p.add_argument("--prompt-model", help="prompt model (export --prompts) for foa, foa-dagger "
                   "and eva0-clubs (default: the shipped model's prompt variant, cached)")
    _add_runtime_options(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("serve", help="Open Inference Protocol server that adapts online")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--name", help="model name in the URLs (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--method", default="eva0", type=_engine_method, help=METHOD_HELP)
    p.add_argument("--max-batch", type=int, default=64,
                   help="most rows per adaptation step and per request (default 64)")
    p.add_argument("--max-delay-ms", type=float, default=10.0,
                   help="how long a request waits for others to join its step (default 10)")
    p.add_argument("--state-dir", help="snapshot folder: resumed from at start, written to "
                   "every --snapshot-every steps and at shutdown")
    p.add_argument("--snapshot-every", type=int, default=100, help="steps (default 100)")
    p.add_argument("--keep-snapshots", type=int, default=3, help="newest kept (default 3)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="request limit (MiB)")
    p.add_argument("--max-pixels-mp", type=float, default=32.0,
                   help="decoded megapixels per 'images' request (default 32)")
    p.add_argument("--fixed-delay", action="store_true",
                   help="always let the oldest request wait up to --max-delay-ms for others "
                   "(default: wait only while more requests are being decoded)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive; later: 408 and the "
                   "connection closed (default 10)")
    p.add_argument("--admin-token", help="bearer token of the admin endpoints (reset, PUT "
                   "state; default: $EVA0_ADMIN_TOKEN); without one they are refused off "
                   "loopback")
    p.add_argument("--summary-every", type=float, default=30.0,
                   help="seconds between info-level summaries (default 30)")
    p.add_argument("--threads", type=int, help="ORT intra-op threads")
    p.add_argument("--low-memory", action="store_true", help=LOW_MEMORY_HELP)
    p.add_argument("--io-binding", action="store_true", help=IO_BINDING_HELP)
    p.add_argument("--seed", type=int, default=0, help="perturbation seed (default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="hyper-parameter override, repeatable")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("bench", help="step cost (time, memory) of methods against NoAdapt")
    p.add_argument("--model", help="adaptable .onnx file")
    p.add_argument("--arch", help="timm architecture, exported with random weights (cached)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    p.add_argument("--methods", default="noadapt,eva0,zoa,foa,tent", help="comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed repetitions (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=int, help="intra-op threads (default: ORT's / torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    p.add_argument("--torch-checkpoint", help="torch weights for tent on a non-shipped model")
    p.add_argument("--prompt-model", help="prompt model for foa / foa-dagger / eva0-clubs "
                   "(default: exported from --arch, or the shipped model's prompt variant)")
    p.add_argument("--seed", type=int, default=0, help="weight seed for --arch (default 0)")
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"],
                   help="ORT provider of the runtime methods (default cpu; tent stays in torch "
                   "on the CPU)")
    p.add_argument("--out", help="folder for cost.md / cost.json / cost.png")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-batch lines")
    p.set_defaults(func=_cmd_bench)
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
    except (FileNotFoundError, ModelFormatError, InputError, StateError, ValueError) as err:
        print(f"eva0-edge {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
