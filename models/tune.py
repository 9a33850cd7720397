"""Recipe: tune EVA-0's hyper-parameters for a shipped model on the *validation* split (5000
held-out train images, corrupted with the validation seed; never the test split), then store
the winners in the model file as its recommended values.

    python models/tune.py --model models/vit_fmnist.onnx
    python models/tune.py --model models/resnet_gn_fmnist.onnx
    python models/tune.py --model models/vit_fmnist.onnx --method eva0-clubs --lambdas 0

``--method eva0-clubs`` tunes the black-box prompt method on the model's prompt variant
(``bench.prompt_variant``): the log goes to ``models/<arch>_prompt.tune.json``, whose best values
the prompt variant carries as its recommended ones.

The grid covers the step size eta, the alignment weight lambda, and both readings of rho (the
weight of the history, 0.999, as DESIGN reads it; the paper's literal (1 - rho) = 0.999 on the
history, i.e. rho = 0.001 as the history weight). Scored by the mean accuracy over the 15
corruptions (single-domain protocol, severity 5, ``--limit`` images each, batch 64).
Writes ``models/<name>.tune.json`` with every configuration's score.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

from eva0_edge.bench.evaluate import EvalSpec, evaluate
from eva0_edge.bench.prompt_variant import tune_log_path
from eva0_edge.runtime.methods import is_prompt_method
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata


def grid(
    family: str,
    etas: list[float] | None = None,
    lambdas: list[float] | None = None,
    rhos: list[float] | None = None,
) -> list[dict]:
    """The configurations to score; defaults span the paper's values."""
    paper_lambda = 500.0 if family == "vit" else 50.0
    etas = etas or [0.001, 0.002, 0.005, 0.01, 0.02]
    lambdas = lambdas or [0.0, paper_lambda / 10, paper_lambda]
    rhos = rhos or [0.999, 0.001]
    configs = []
    for eta, lam, rho in itertools.product(etas, lambdas, rhos):
        if lam == 0.0 and rho != rhos[0]:
            continue  # rho only matters when the alignment term is on
        configs.append({"eta": eta, "lambda_swa": lam, "rho": rho})
    return configs


def _floats(text: str | None) -> list[float] | None:
    return [float(v) for v in text.split(",")] if text else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, help="ORT intra-op threads")
    parser.add_argument("--etas", help="comma-separated grid of eta (default 0.001..0.02)")
    parser.add_argument("--lambdas", help="comma-separated grid of lambda_swa")
    parser.add_argument("--rhos", help="comma-separated grid of rho (default 0.999,0.001)")
    parser.add_argument("--log", help="tuning log (default models/<name>.tune.json)")
    parser.add_argument("--method", default="eva0", help="eva0 (default) or eva0-clubs")
    args = parser.parse_args()
    prompt = is_prompt_method(args.method)
    metadata = read_metadata(args.model)
    rows = []
    start = time.time()
    configs = grid(metadata.family, _floats(args.etas), _floats(args.lambdas), _floats(args.rhos))
    for config in configs:
        spec = EvalSpec(
            model=args.model, dataset="fmnist-c", protocol="single", severity=args.severity,
            batch_size=args.batch_size, methods=[args.method], limit=args.limit, split="val",
            overrides=config, provider="cpu", threads=args.threads,
        )
        result = evaluate(spec, progress=False)[args.method]
        rows.append({**config, "val_accuracy": result.average})
        print(json.dumps(rows[-1]), flush=True)
    baseline = evaluate(
        EvalSpec(model=args.model, dataset="fmnist-c", protocol="single", severity=args.severity,
                 batch_size=args.batch_size, methods=["noadapt"], limit=args.limit,
                 split="val", provider="cpu", threads=args.threads),
        progress=False,
    )["noadapt"].average
    best = max(rows, key=lambda r: r["val_accuracy"])
    chosen = {k: v for k, v in best.items() if k != "val_accuracy"}
    if not prompt:
        model = load_onnx(args.model)
        metadata = read_metadata(model)
        metadata.recommended = {**metadata.recommended, **chosen}
        save_onnx(set_metadata(model, metadata), args.model)
    report = {
        "model": Path(args.model).name, "method": args.method, "split": "val",
        "severity": args.severity,
        "limit": args.limit, "batch_size": args.batch_size, "noadapt_val_accuracy": baseline,
        "best": best, "grid": rows, "seconds": time.time() - start,
        "load_average": os.getloadavg(),
    }
    if args.log:
        out = Path(args.log)
    else:
        out = tune_log_path(metadata.architecture) if prompt else Path(args.model).with_suffix(
            ".tune.json"
        )
    out.write_text(json.dumps(report, indent=2) + "\n")
    target = "the prompt variant" if prompt else args.model
    print(f"best {best} (noadapt {baseline:.2f}) -> recommended in {target}; log {out}")


if __name__ == "__main__":
    main()
