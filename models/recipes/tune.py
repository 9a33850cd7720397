"""Recipe: tune a method for a shipped model on the *validation* split (5000 held-out train
images, corrupted with the validation seed; never the test split), the way the product is used:
at several batch sizes, in the single and the continual protocol, and on clean images.

    python models/recipes/tune.py --model models/vit_fmnist.onnx --method eva0 --write
    python models/recipes/tune.py --model models/vit_fmnist.onnx --method tent --write
    python models/recipes/tune.py --model models/vit_fmnist.onnx --method eva0 \
        --grid eta=0.002,0.004

Every configuration runs on the same images: severity 5, ``--limit`` images per corruption,
batch sizes ``--batch-sizes`` (default 1,4,16,64), both protocols; plus ``--clean-limit`` clean
validation images at the same batch sizes. Choice: among the configurations that never lose
more than ``--clean-margin`` (0.5) points to NoAdapt on the clean images, the best worst
corrupted cell (the product must gain at every batch size and in both protocols, not on
average; ties go to the better mean); if none qualifies, the best worst case over all cells
(accuracy minus NoAdapt's). ``--from-log`` re-applies the rule to a log without rescoring.

Default grid: the step size at 0.5, 1, 2, 4, 8 and 16 times its current value (``eta`` for the
runtime methods, the batch-64 ``lr`` for TENT / SAR / DeYO, which scale it with the batch as
their authors' code does); ``make tune`` gives every runtime method the grid eva0 had. While the
best sits on an edge of the grid, the next point past it is scored too (at most ``--extend``,
2). ``--write`` stores the winner in the model file's ``tuned`` values for that method (and, for
eva0, in ``recommended``, except the activation shift, which stays eva0's own). The log goes
to ``models/<name>.tune-<method>.json``.

``--set KEY=VALUE`` runs every configuration with a value that is not tuned, ``--protocols``
picks the corrupted protocols scored, and ``--max-forwards F`` makes a configuration eligible
only when every corrupted cell's measured forwards per sample stays within what a budget of F
may spend there: F plus the full bucket the budget starts with and one batch, spread over the
samples the bucket serves (``runtime.budget.forwards_bound``; a strict F marked every spent
budget ineligible: 1.5008 at F = 1.5 over 15000 samples). The compute budget's bucket
(``budget_burst``) was tuned this way, at the budget it serves:

    python models/recipes/tune.py --model models/vit_fmnist.onnx --method eva0 \
        --protocols continual --set budget=1.5 --grid budget_burst=512,1024,2048 --limit 1000 \
        --clean-limit 1000 --batch-sizes 1,16,64 --max-forwards 1.5 \
        --log models/vit_fmnist.tune-eva0-burst-1.5.json

``--method foa`` runs on the model's prompt variant (``bench.testbed.prompt_variant``) by the
same rule; its default grid is ``lambda_fit`` (the fitness's feature-statistics weight) at the
scales above, and the winner goes into the shipped file's ``tuned`` values, which the prompt
variant carries.

``--method eva0-clubs`` tunes the black-box prompt method on the model's prompt variant
(``bench.testbed.prompt_variant``) at one batch size, as before: its log is
``models/<arch>_prompt.tune.json``, whose best values the prompt variant carries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate, load_domains
from eva0_edge.bench.testbed.fashion_mnist import VAL_SIZE
from eva0_edge.bench.testbed.prompt_variant import tune_log_path
from eva0_edge.bench.testbed.tuner import (
    PROTOCOLS,
    TuneData,
    TuneSettings,
    default_grid,
    run_tuning,
    write_choice,
)
from eva0_edge.bench.testbed.tuning import choose, parse_grid
from eva0_edge.runtime.config import parse_key_values
from eva0_edge.runtime.methods import is_prompt_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import SessionSettings


def validation_data(model: str, limit: int, clean_limit: int, severity: int) -> TuneData:
    """Fashion-MNIST-C's validation split: ``limit`` images of each corruption at
    ``severity`` and ``clean_limit`` clean images (seeded subsets)."""
    common = dict(model=model, dataset="fmnist-c", protocol="single", severity=severity,
                  batch_size=64, methods=["noadapt"], split="val")
    return TuneData(
        load_domains(EvalSpec(limit=limit, **common), progress=False),
        load_domains(EvalSpec(limit=clean_limit, corruptions=["clean"], **common),
                     progress=False),
        "fmnist-c", severity)


def rates_record(log: dict) -> dict:
    """The model file's ``fitted`` record of a tuning log (what the rates were tuned on)."""
    return {"by": "models/recipes/tune.py", "images": VAL_SIZE, "split": "val",
            "clean_images": log.get("clean_limit"), "corruptions": 15,
            "images_per_corruption": log.get("limit"), "severity": log.get("severity"),
            "batch_sizes": log.get("batch_sizes"), "values": log["best"]["config"],
            "eligible": log["best"]["eligible"]}


def tune_prompt_method(args: argparse.Namespace) -> None:
    """eva0-clubs on the prompt variant: single protocol, one batch size, mean accuracy."""
    rows = []
    for config in parse_grid(args.grid) if args.grid else default_grid(args.model, "eva0"):
        spec = EvalSpec(
            model=args.model, dataset="fmnist-c", protocol="single", severity=args.severity,
            batch_size=args.batch_sizes[-1], methods=[args.method], limit=args.limit,
            split="val", overrides=config,
            session=SessionSettings(provider="cpu", threads=args.threads),
        )
        rows.append({**config, "val_accuracy": evaluate(spec, progress=False)[args.method].average})
        print(json.dumps(rows[-1]), flush=True)
    best = max(rows, key=lambda r: r["val_accuracy"])
    out = Path(args.log) if args.log else tune_log_path(read_metadata(args.model).architecture)
    out.write_text(json.dumps({"method": args.method, "best": best, "grid": rows}, indent=2))
    print(f"best {best}; log {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", default="eva0")
    parser.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                        help="grid axis, repeatable (default: the step size x 0.5 .. 16)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a value every configuration runs with (not tuned), e.g. budget=1.5")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS),
                        help="corrupted protocols scored (default single,continual)")
    parser.add_argument("--max-forwards", type=float, help="eligible only when every corrupted "
                        "cell's measured forwards per sample stays within this (a budget's)")
    parser.add_argument("--limit", type=int, default=100, help="images per corruption")
    parser.add_argument("--clean-limit", type=int, default=500, help="clean images")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--clean-margin", type=float, default=0.5)
    parser.add_argument("--extend", type=int, default=2, help="points added past a grid edge "
                        "while the best sits on it (default 2)")
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="ORT / torch threads")
    parser.add_argument("--write", action="store_true", help="store the winner in the model")
    parser.add_argument("--log", help="tuning log (default models/<name>.tune-<method>.json)")
    parser.add_argument("--from-log", action="store_true",
                        help="re-apply the choice to the existing log instead of scoring")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if is_prompt_method(args.method):
        tune_prompt_method(args)
        return
    out = Path(args.log) if args.log else Path(args.model).with_name(
        f"{Path(args.model).stem}.tune-{args.method}.json"
    )
    if args.from_log:
        logged = json.loads(out.read_text())
        best = choose(logged["grid"], logged["noadapt"], args.clean_margin,
                      logged.get("max_forwards"))
        logged["best"] = best
        out.write_text(json.dumps(logged, indent=2) + "\n")
        if args.write:
            write_choice(args.model, args.method, best["config"], rates_record(logged))
        print(f"{args.method}: best {best['config']} (re-chosen from {out})")
        return
    settings = TuneSettings(
        batch_sizes=args.batch_sizes,
        protocols=[p.strip() for p in args.protocols.split(",") if p.strip()],
        clean_margin=args.clean_margin, max_forwards=args.max_forwards,
        fixed=parse_key_values(args.set), extend=args.extend, threads=args.threads)
    configs = parse_grid(args.grid) if args.grid else default_grid(args.model, args.method)
    data = validation_data(args.model, args.limit, args.clean_limit, args.severity)
    report = run_tuning(args.model, args.method, configs, data, settings, progress=False,
                        echo=lambda row: print(json.dumps(row), flush=True))
    best = report["best"]
    report = {"model": Path(args.model).name, **report, "limit": args.limit,
              "clean_limit": args.clean_limit}
    if args.write:
        write_choice(args.model, args.method, best["config"], rates_record(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.method}: best {best['config']} (mean {best['mean_corrupted']:.2f}, worst gain "
          f"{best['worst_gain']:+.2f}, eligible {best['eligible']}) -> log {out}")


if __name__ == "__main__":
    main()
