"""Recipe: learn the activation shift's bound ``shift_max`` for a shipped model on the
*validation* split.

    python models/recipes/shift_bound.py --model models/resnet_gn_fmnist.onnx --write

For each validation domain (the 15 corruptions at severity 5 and the clean images, ``--limit``
images each) the distance ||m_source - m_domain|| between the source's mean head input and the
domain's, at theta0: the largest shift a healthy stream asks for. The bound is the largest
distance times ``--margin`` (1.5). A stream beyond it (black, white or noise frames) restarts
the shift's window and is served unshifted (:mod:`eva0_edge.runtime.shift`). ``--write``
stores it in eva0's tuned values; the log goes to ``models/<name>.shift-bound.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS
from eva0_edge.bench.testbed.datasets import CLEAN, fmnist_c_domains
from eva0_edge.bench.testbed.tuner import write_choice
from eva0_edge.runtime.fitting import fit_record, head_distances
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=1000, help="images per domain")
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--margin", type=float, default=1.5)
    parser.add_argument("--write", action="store_true", help="store it in eva0's tuned values")
    args = parser.parse_args()
    domains = fmnist_c_domains(args.severity, "val", corruptions=[*CORRUPTIONS, CLEAN],
                               indices=np.arange(args.limit), progress=False)
    distances = head_distances(args.model, {d.name: d.images for d in domains})
    bound = float(f"{max(distances.values()) * args.margin:.4g}")
    log = {"model": Path(args.model).name, "split": "val", "severity": args.severity,
           "limit": args.limit, "margin": args.margin, "distances": distances,
           "shift_max": bound}
    out = Path(args.model).with_name(f"{Path(args.model).stem}.shift-bound.json")
    out.write_text(json.dumps(log, indent=2) + "\n")
    if args.write:
        write_choice(args.model, "eva0", {"shift_max": bound})
        model = load_onnx(args.model)
        metadata = read_metadata(model)
        metadata.fitted = {**metadata.fitted, "activation_shift": fit_record(
            "models/recipes/shift_bound.py", args.limit, len(CORRUPTIONS), args.limit,
            args.severity, args.margin, shift_max=bound)}
        save_onnx(set_metadata(model, metadata), args.model)
    print(f"shift_max {bound} (largest validation distance {max(distances.values()):.3g} x "
          f"{args.margin}) -> log {out}")


if __name__ == "__main__":
    main()
