"""``eva0-edge eval`` and ``eva0-edge bench`` (need the [bench] extra)."""

from __future__ import annotations

import argparse
import logging

from eva0_edge.bench.testbed.protocols import PROTOCOLS, SEVERITIES, SOAK_PASSES
from eva0_edge.runtime.cli import (
    add_runtime_options,
    budget_list,
    int_in,
    int_list,
    method_overrides,
    missing_extra,
    session_settings,
    split_names,
)

# where the steps' routine warnings come from: skipped steps (the engine), the health guard's
# trips and verdicts (the policy), a method's values on a file without source statistics or
# a shiftable head (the config, the shift)
QUIET_LOGGERS = ("eva0_edge.runtime.engine", "eva0_edge.runtime.policy",
                 "eva0_edge.runtime.config", "eva0_edge.runtime.shift")


def severity_list(text: str) -> int | list[int]:
    """An argparse type: corruption severities, ``"5"`` -> 5 (one stays an int), ``"1-5"`` ->
    [1, 2, 3, 4, 5], ``"1,3,5"`` -> [1, 3, 5]; each in 1..5, none twice."""
    parts = split_names(text)
    try:
        if len(parts) == 1 and "-" in parts[0]:
            low, _, high = parts[0].partition("-")
            values = list(range(int(low), int(high) + 1))
        else:
            values = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a severity, range or list: {text!r} (e.g. 5, 1-5 or 1,3,5)") from None
    bad = [v for v in values if v not in SEVERITIES]
    if not values or bad or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(
            f"severities are distinct values in 1..5 (e.g. 5, 1-5 or 1,3,5), got {text!r}")
    return values[0] if len(values) == 1 else values


def quiet_routine_warnings(verbose: int) -> None:
    """Trips and skips are routine on corrupted streams: a report (``eval``, ``tune``) says
    what happened, so their warnings show only with ``-v``."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)


def _cmd_eval(args: argparse.Namespace) -> None:
    try:
        from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate
        from eva0_edge.bench.testbed.report import markdown_table
    except ImportError as err:
        raise missing_extra("eval", "bench", err) from err
    quiet_routine_warnings(args.verbose)
    if args.ray is not None and not isinstance(args.severity, int):
        raise ValueError("eval --ray runs one severity per call; give --severity one value")
    spec = EvalSpec(
        model=args.model,
        dataset=args.dataset,
        protocol=args.protocol,
        severity=args.severity,
        batch_size=args.batch_size,
        methods=split_names(args.methods),
        batch_sizes=args.batch_sizes,
        corruptions=split_names(args.corruptions) if args.corruptions else None,
        seed=args.seed,
        limit=args.limit,
        split=args.split,
        overrides=method_overrides(args),
        torch_checkpoint=args.torch_checkpoint,
        session=session_settings(args),
        prompt_model=args.prompt_model,
        soak_passes=args.soak_passes,
    )
    if args.ray is None:
        results = evaluate(spec, args.out, progress=not args.quiet)
    else:
        try:
            from eva0_edge.bench.fanout import evaluate_on_ray
        except ImportError as err:
            raise missing_extra("eval --ray", "fleet", err) from err
        address = None if args.ray == "local" else args.ray
        results = evaluate_on_ray(spec, address, args.out)
    print(markdown_table(results))
    for name, result in results.items():
        if result.skipped_steps:
            print(f"{name}: {result.skipped_steps} adaptation steps skipped (non-finite)")
    if args.out:
        print(f"report: {args.out}/results.md, results.json, stream.png")


def concrete_provider(provider: str) -> str:
    """``cpu`` or ``cuda`` for a provider name (``auto``: CUDA when a GPU is usable)."""
    from eva0_edge.runtime.session import PROVIDERS, resolve_providers

    return "cuda" if resolve_providers(provider)[0] == PROVIDERS["cuda"] else "cpu"


def _cmd_bench(args: argparse.Namespace) -> None:
    from pathlib import Path

    try:
        from eva0_edge.bench.cost import (
            bench_prompt_model,
            fitting_methods,
            markdown,
            run_bench,
            write_outputs,
        )
        from eva0_edge.bench.testbed.workload import export_random
        from eva0_edge.runtime.cache import cache_dir
    except ImportError as err:
        raise missing_extra("bench", "bench", err) from err
    if bool(args.model) == bool(args.arch):
        raise ValueError("give exactly one of --model FILE or --arch TIMM_NAME")
    if args.adapt and not args.arch:
        raise ValueError("--adapt picks the layers of an --arch export (a --model file has its "
                         "own)")
    torch_spec = {"checkpoint": args.torch_checkpoint}
    model = args.model
    if args.arch:
        model = str(export_random(args.arch, cache_dir() / "bench-models", args.seed,
                                  adapt=args.adapt))
        torch_spec = {"arch": args.arch, "seed": args.seed}
    if args.methods is None:
        methods, skipped = fitting_methods(model, args.arch, args.seed, args.prompt_model,
                                           args.torch_checkpoint)
        for method, why in skipped.items():
            print(f"skipped {method}: {why}")
    else:
        methods = split_names(args.methods)
    report = run_bench(
        model,
        args.batch_sizes,
        methods,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        memory=not args.no_memory,
        torch_spec=torch_spec,
        progress=not args.quiet,
        prompt_model=bench_prompt_model(model, args.arch, args.seed, args.prompt_model, methods),
        provider=concrete_provider(args.provider),
        budgets=args.budgets or (),
    )
    print(markdown(report))
    if args.out:
        write_outputs(report, Path(args.out))
        print(f"report: {args.out}/cost.md, cost.json, cost.png")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy of methods under a protocol on corrupted data")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument(
        "--dataset", default="fmnist-c",
        help="fmnist-c (generated into the cache) or an ImageNet-C-style folder "
        "corruption/severity/class/image",
    )
    p.add_argument("--protocol", default="single", choices=PROTOCOLS,
                   help="default single; soak: the continual stream --soak-passes times in a "
                   "row; gradual: each corruption's severity 1->5->1 in one stream (it takes "
                   "no --severity); mixed: every corruption's images shuffled into one stream")
    p.add_argument("--severity", type=severity_list, default=5, metavar="S",
                   help="corruption severity 1-5, or several (1-5, 1,3,5): each its own run, "
                   "a row per severity (default 5; gradual runs all five by itself)")
    p.add_argument("--soak-passes", type=int_in(1), default=SOAK_PASSES, metavar="N",
                   help="passes of the soak protocol (default %(default)s)")
    p.add_argument("--methods", default="noadapt,eva0", help="comma-separated (default "
                   "noadapt,eva0); runtime methods (name@FP sets #FP, e.g. eva0-clubs@8, "
                   "foa-dagger@14) plus the torch baselines tent, sar, deyo, bn-adapt, bn-ema")
    p.add_argument("--limit", type=int_in(1), help="images per corruption (a seeded subset)")
    p.add_argument("--batch-sizes", type=int_list, help="comma-separated: one run per batch "
                   "size in one report (a row per method and batch size); overrides --batch-size")
    p.add_argument("--corruptions", help="comma-separated domains (default: all 15); 'clean' "
                   "is the uncorrupted images; hostile streams: black, white, repeat, noise, "
                   "burst, alternate, and sensor faults gauss-S (noise std S on [0, 1]), blur-R, "
                   "jpeg-Q (e.g. --protocol continual --corruptions black,clean,gauss-0.3,clean)")
    p.add_argument("--split", default="test", choices=["test", "val"],
                   help="fmnist-c: test, or val (held-out train images, for tuning)")
    p.add_argument("--torch-checkpoint", help="torch weights for tent/sar/deyo on a non-shipped "
                   "model")
    p.add_argument("--out", help="folder for results.md / results.json / stream.png")
    p.add_argument("--threads", type=int_in(1), help="intra-op threads of ORT and torch")
    p.add_argument("--prompt-model", help="prompt model (export --prompts) for foa, foa-dagger "
                   "and eva0-clubs (default: the shipped model's prompt variant, cached)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run the independent cells as Ray tasks, on a local instance or the "
                   "cluster at ADDRESS (the [fleet] extra); same results as a local run")
    add_runtime_options(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("bench", help="step cost (time, memory) of methods against NoAdapt")
    p.add_argument("--model", help="adaptable .onnx file")
    p.add_argument("--arch", help="timm architecture, exported with random weights (cached)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32],
                   help="comma-separated (default 1,8,32)")
    p.add_argument("--methods", help="comma-separated (default: noadapt,eva0,zoa,foa,tent, "
                   "less those the model cannot run, each named with the reason)")
    p.add_argument("--repeats", type=int_in(1), default=10,
                   help="timed repetitions (default 10)")
    p.add_argument("--warmup", type=int_in(0), default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=int_in(1), help="intra-op threads (default: ORT's / torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    p.add_argument("--torch-checkpoint", help="torch weights for tent on a non-shipped model")
    p.add_argument("--prompt-model", help="prompt model for foa / foa-dagger / eva0-clubs "
                   "(default: exported from --arch, or the shipped model's prompt variant)")
    p.add_argument("--seed", type=int, default=0, help="weight seed for --arch (default 0)")
    p.add_argument("--adapt", help="the --arch export's adapted layers, as `export --adapt` "
                   "takes them (default: the exporter's)")
    p.add_argument("--provider", default="cpu", choices=["auto", "cpu", "cuda"],
                   help="ORT provider of the runtime methods (default cpu; tent stays in torch "
                   "on the CPU)")
    p.add_argument("--budgets", type=budget_list, help="comma-separated compute budgets "
                   "(forwards per sample): a row 'METHOD budget F' per adapting runtime method "
                   "(at most its own forwards), its settled schedule's mean time and measured "
                   "forwards per sample")
    p.add_argument("--out", help="folder for cost.md / cost.json / cost.png")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-batch lines")
    p.set_defaults(func=_cmd_bench)
