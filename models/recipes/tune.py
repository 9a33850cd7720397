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
import os
import time
from pathlib import Path
from typing import Any

from eva0_edge.bench.testbed.backprop import PAPER_LR
from eva0_edge.bench.testbed.bnstats import BN_METHODS
from eva0_edge.bench.testbed.bnstats import DEFAULTS as BN_DEFAULTS
from eva0_edge.bench.testbed.evaluate import BACKPROP, EvalSpec, evaluate
from eva0_edge.bench.testbed.prompt_variant import tune_log_path
from eva0_edge.bench.testbed.tuning import beyond_edge, choose, parse_grid, spending_bound
from eva0_edge.runtime.config import AdaptConfig, parse_key_values
from eva0_edge.runtime.foa import FOA_METHODS, FOAConfig
from eva0_edge.runtime.methods import is_prompt_method
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import SessionSettings

PROTOCOLS = ("single", "continual")
SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
EVA0_ONLY = {"activation_shift", "shift_window", "shift_max"}


def current_values(model: str, method: str) -> dict[str, float]:
    """The step size ``method`` runs with today on ``model`` (before tuning)."""
    metadata = read_metadata(model)
    if method in FOA_METHODS:
        return {"lambda_fit": FOAConfig().updated(metadata.tuned.get(method, {})).lambda_fit}
    if method in BN_METHODS:
        (key, value), = {**BN_DEFAULTS[method], **metadata.tuned.get(method, {})}.items()
        return {key: float(value)}
    if method in BACKPROP:
        default = PAPER_LR.get(metadata.family, 1e-3)
        return {"lr": metadata.tuned.get(method, {}).get("lr", default)}
    return {"eta": Policy.load(model, method, provider="cpu").config.eta}


def default_grid(model: str, method: str) -> list[dict[str, float]]:
    """The step size at :data:`SCALES` times its current value."""
    (key, value), = current_values(model, method).items()
    return [{key: float(f"{value * s:.6g}")} for s in SCALES]


def score(
    args: argparse.Namespace, method: str, overrides: dict[str, Any]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Accuracy (%) per cell, ``<protocol> B=<b>`` (corrupted average) and ``clean B=<b>``,
    each corrupted cell's measured forwards per sample, and (with ``args.max_forwards``) the
    most a budget of that many forwards may spend in the cell; ``args.fixed`` applies under
    ``overrides``."""
    common = dict(
        model=args.model, dataset="fmnist-c", severity=args.severity, batch_size=64,
        methods=[method], batch_sizes=args.batch_sizes, split="val",
        overrides={**args.fixed, **overrides},
        session=SessionSettings(provider="cpu", threads=args.threads),
    )
    cells, forwards, bounds = {}, {}, {}
    for protocol in args.protocols:
        results = evaluate(EvalSpec(protocol=protocol, limit=args.limit, **common), progress=False)
        for r in results.values():
            cell = f"{protocol} B={r.batch}"
            cells[cell], forwards[cell] = r.average, r.forwards_per_sample
            if args.max_forwards is not None:
                bounds[cell] = spending_bound(args.max_forwards, protocol, r)
    clean = evaluate(
        EvalSpec(protocol="single", limit=args.clean_limit, corruptions=["clean"], **common),
        progress=False,
    )
    cells.update({f"clean B={r.batch}": r.average for r in clean.values()})
    return cells, forwards, bounds


def noadapt_reference(args: argparse.Namespace) -> dict[str, float]:
    """NoAdapt on the same images (it does not depend on the batch size)."""
    args_64 = argparse.Namespace(**{**vars(args), "batch_sizes": [64], "fixed": {}})
    cells, _, _ = score(args_64, "noadapt", {})
    return {
        f"{kind} B={b}": cells[f"{kind} B=64"]
        for kind in (*args.protocols, "clean") for b in args.batch_sizes
    }


def write_choice(model_path: str, method: str, values: dict[str, Any]) -> None:
    """Store ``values`` as ``method``'s tuned values in the model file (eva0's also as the
    file's recommended values)."""
    model = load_onnx(model_path)
    metadata = read_metadata(model)
    metadata.tuned = {**metadata.tuned, method: {**metadata.tuned.get(method, {}), **values}}
    if method == "eva0":  # the activation shift stays eva0's: NoAdapt and the peers read
        shared = {k: v for k, v in values.items() if k not in EVA0_ONLY}  # recommended too
        metadata.recommended = {**metadata.recommended, **shared}
    save_onnx(set_metadata(model, metadata), model_path)


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
    args.protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    args.fixed = parse_key_values(args.set)
    if args.method in FOA_METHODS:
        known = set(FOAConfig.__dataclass_fields__)
    elif args.method in BN_METHODS:
        known = set(BN_DEFAULTS[args.method])
    elif args.method in BACKPROP:
        known = {"lr"}
    elif is_prompt_method(args.method):
        tune_prompt_method(args)
        return
    else:
        known = set(AdaptConfig.__dataclass_fields__)
    unknown = {k for c in parse_grid(args.grid or []) for k in c} - known
    if unknown:
        raise SystemExit(f"--grid keys {sorted(unknown)} do not apply to {args.method}")
    start = time.time()
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
            write_choice(args.model, args.method, best["config"])
        print(f"{args.method}: best {best['config']} (re-chosen from {out})")
        return
    configs = parse_grid(args.grid) if args.grid else default_grid(args.model, args.method)
    reference = noadapt_reference(args)
    print(json.dumps({"noadapt": reference}), flush=True)

    def scored(config: dict[str, Any]) -> dict[str, Any]:
        cells, forwards, bounds = score(args, args.method, config)
        row = {"config": config, "cells": cells, "forwards": forwards, "forwards_bound": bounds}
        print(json.dumps(row), flush=True)
        return row

    rows = [scored(config) for config in configs]
    best = choose(rows, reference, args.clean_margin, args.max_forwards)
    for _ in range(args.extend):
        beyond = beyond_edge(best["config"], [row["config"] for row in rows])
        if beyond is None:
            break
        rows.append(scored(beyond))
        best = choose(rows, reference, args.clean_margin, args.max_forwards)
    if args.write:
        write_choice(args.model, args.method, best["config"])
    report = {
        "model": Path(args.model).name, "method": args.method, "split": "val",
        "severity": args.severity, "limit": args.limit, "clean_limit": args.clean_limit,
        "batch_sizes": args.batch_sizes, "clean_margin": args.clean_margin,
        "protocols": args.protocols, "fixed": args.fixed, "max_forwards": args.max_forwards,
        "noadapt": reference, "best": best, "grid": rows,
        "seconds": time.time() - start, "load_average": os.getloadavg(),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.method}: best {best['config']} (mean {best['mean_corrupted']:.2f}, worst gain "
          f"{best['worst_gain']:+.2f}, eligible {best['eligible']}) -> log {out}")


if __name__ == "__main__":
    main()
