"""Recipe: learn the health guard's bounds for a shipped model on the *validation* split.

    python models/recipes/guard_bounds.py --model models/resnet_gn_fmnist.onnx --write

Runs EVA-0 (the file's recommended values, guard watching but never tripping) over the
validation streams a healthy device sees: clean images and the 15-corruption continual stream
(severity 5), at batch sizes 1, 16 and 64, and records every windowed signal of
:mod:`eva0_edge.runtime.guard` from the guard's warm-up on (as the guard checks them). The
bounds are the extremes seen with a margin (default 2): lower bounds at min / margin (entropy,
spread, logit norm), upper bounds at max x margin (logit norm, drift, feature distance),
entropy's upper bound at 1 - (1 - max) / margin. ``--write`` stores them in the file's
recommended values and turns the guard on for eva0 (its ``tuned`` values; the paper's
baselines run as published); the log goes to ``models/<name>.guard.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from eva0_edge.bench.testbed.evaluate import EvalSpec, load_domains
from eva0_edge.runtime.guard import GuardBounds
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from eva0_edge.runtime.policy import Policy

WATCH_ONLY = {"guard": True, **{f"guard_{name}": None for name in GuardBounds.__dataclass_fields__}}
SIGNALS = ("entropy", "spread", "logit_norm", "drift", "alignment")


def record(model_path: str, domains, batch: int, threads: int) -> dict[str, list[float]]:
    """Every full-window value of every signal along one stream (no reset between domains)."""
    model = Policy.load(model_path, "eva0", WATCH_ONLY, provider="cpu", threads=threads)
    pre = model.metadata.preprocessing
    seen: dict[str, list[float]] = {name: [] for name in SIGNALS}
    for domain in domains:
        for x, _ in domain.batches(batch, pre):
            model.step(x)
            if model.guard.windows.samples < model.guard.warmup:
                continue
            for name, value in model.stats()["guard"]["signals"].items():
                if value is not None:
                    seen[name].append(float(value))
    return seen


def learnt_bounds(extremes: dict[str, dict], margin: float) -> dict[str, float]:
    """The guard_* values from the [min, max] of every signal in every stream: lower bounds
    at min / margin (entropy's upper bound: the distance to 1 divided by the margin), upper
    bounds at max x margin."""
    def rounded(value: float) -> float:
        return float(f"{value:.4g}")

    seen = [n for n in SIGNALS if any(e[n] for e in extremes.values())]
    lows = {n: min(e[n][0] for e in extremes.values() if e[n]) for n in seen}
    highs = {n: max(e[n][1] for e in extremes.values() if e[n]) for n in seen}
    bounds = {
        "guard_entropy_min": lows["entropy"] / margin,
        "guard_entropy_max": 1.0 - (1.0 - highs["entropy"]) / margin,
        "guard_spread_min": lows["spread"] / margin,
        "guard_logit_norm_min": lows["logit_norm"] / margin,
        "guard_logit_norm_max": highs["logit_norm"] * margin,
        "guard_drift_max": highs["drift"] * margin,
    }
    if "alignment" in seen:  # only with source statistics
        bounds["guard_alignment_max"] = highs["alignment"] * margin
    return {name: rounded(value) for name, value in bounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=300, help="images per corruption")
    parser.add_argument("--clean-limit", type=int, default=2000)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--margin", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    start = time.time()
    common = dict(model=args.model, dataset="fmnist-c", protocol="continual", severity=5,
                  batch_size=64, methods=["eva0"], split="val")
    streams = {
        "clean": load_domains(EvalSpec(limit=args.clean_limit, corruptions=["clean"], **common),
                              progress=False),
        "continual": load_domains(EvalSpec(limit=args.limit, **common), progress=False),
    }
    extremes: dict[str, dict] = {}
    for stream, domains in streams.items():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            seen = record(args.model, domains, batch, args.threads)
            extremes[f"{stream} B={batch}"] = {
                name: [min(v), max(v)] if v else None for name, v in seen.items()
            }
            print(json.dumps({f"{stream} B={batch}": extremes[f"{stream} B={batch}"]}),
                  flush=True)
    bounds = learnt_bounds(extremes, args.margin)
    if args.write:
        model = load_onnx(args.model)
        metadata = read_metadata(model)
        metadata.recommended = {**metadata.recommended, **bounds}
        metadata.tuned = {**metadata.tuned, "eva0": {**metadata.tuned.get("eva0", {}),
                                                     "guard": True}}
        save_onnx(set_metadata(model, metadata), args.model)
    log = Path(args.model).with_suffix(".guard.json")
    log.write_text(json.dumps({
        "model": Path(args.model).name, "split": "val", "margin": args.margin,
        "limit": args.limit, "clean_limit": args.clean_limit, "extremes": extremes,
        "bounds": bounds, "seconds": time.time() - start, "load_average": os.getloadavg(),
    }, indent=2) + "\n")
    print(f"bounds {bounds} -> log {log}" + (f", written to {args.model}" if args.write else ""))


if __name__ == "__main__":
    main()
