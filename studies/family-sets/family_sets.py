"""Cost of EVA-0's step against NoAdapt for adapted sets of the BatchNorm edge families.

For each architecture (random weights, 224 px) and each ``--adapt`` set in the family's own
units, export through the graph rewriter and time NoAdapt and EVA-0 interleaved in one process
(``eva0_edge.bench.cost.time_methods``: warm-up, then round-robin repetitions, medians) at the
given batch sizes. Writes ``family_sets.json`` and ``family_sets.md`` (the table) to ``--out``.

    python studies/family-sets/family_sets.py --out results/family-sets
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import timm

from eva0_edge.bench.cost import time_methods
from eva0_edge.bench.testbed.machine import environment
from eva0_edge.exporter import export_model
from eva0_edge.exporter.graph_families import graph_family_for
from eva0_edge.runtime.cache import cache_dir

SETS = {
    # MobileNetV3-Large: units blocks.0 .. blocks.6
    "mobilenetv3_large_100": ["0-6", "2-6", "3-6", "4-6", "5-6", "6"],
    # EfficientNet-Lite0: units blocks.0 .. blocks.6, then bn2 (7)
    "efficientnet_lite0": ["0-7", "2-7", "3-7", "4-7", "5-7", "6-7", "7"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(SETS))
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    env = environment()
    for arch in args.archs.split(","):
        model = timm.create_model(arch, pretrained=False)
        family = graph_family_for(model)
        assert family is not None, arch
        default = family.default(len(family.units(model)))
        for spec in SETS[arch]:
            path = cache_dir() / "family-sets" / f"{arch}-{spec}.onnx"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file():
                metadata = export_model(arch, path, model=timm.create_model(arch), adapt=spec)
            else:
                from eva0_edge.runtime.modelfile import read_metadata

                metadata = read_metadata(path)
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                timed = time_methods(str(path), ["noadapt", "eva0"], batch, args.repeats,
                                     args.warmup, None)
                noadapt, eva0 = timed
                rows.append({
                    "arch": arch, "adapt": spec, "default": spec == default,
                    "params": metadata.num_params, "batch": batch,
                    "noadapt_ms_per_sample": noadapt.ms_per_sample,
                    "eva0_ms_per_sample": eva0.ms_per_sample,
                    "ratio": eva0.ms_per_sample / noadapt.ms_per_sample,
                    "load_average": os.getloadavg()[0],
                })
                print(json.dumps(rows[-1]), flush=True)
    report = {"environment_start": env, "environment_end": environment(), "rows": rows}
    (args.out / "family_sets.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| arch | --adapt | P | B | NoAdapt ms/sample | EVA-0 ms/sample | ratio | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (default)" if r["default"] else ""
        lines.append(f"| {r['arch']} | {r['adapt']}{mark} | {r['params']} | {r['batch']} | "
                     f"{r['noadapt_ms_per_sample']:.2f} | {r['eva0_ms_per_sample']:.2f} | "
                     f"{r['ratio']:.2f} | {r['load_average']:.2f} |")
    (args.out / "family_sets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
