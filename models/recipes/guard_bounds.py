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
from eva0_edge.runtime.fitting import fit_record, learnt_bounds, record_signals
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata


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
            seen = record_signals(args.model, [d.images for d in domains], batch,
                                  threads=args.threads)
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
        metadata.fitted = {**metadata.fitted, "guard": fit_record(
            "models/recipes/guard_bounds.py", args.clean_limit, len(streams["continual"]),
            args.limit, 5, args.margin,
            batch_sizes=sorted({int(k.rsplit("=", 1)[1]) for k in extremes}))}
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
