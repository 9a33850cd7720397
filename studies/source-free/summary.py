"""The summary tables of results/source-free/ (``summary.md``), from the runs' results.json:
per model and batch size, NoAdapt, EVA-0 (calibrated file), the source-free mode on the
never-calibrated copy (eva0-dagger, and eva0 on the set-up file) and the paper's EVA-0-dagger,
the source-free gain and its share of EVA-0's gain; then clean accuracy by batch size.

    python studies/source-free/summary.py [results/source-free]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODELS = ("vit_fmnist", "resnet_gn_fmnist", "mobilenet_bn_fmnist")


def _averages(folder: Path) -> dict[str, float]:
    """``{"<method> B=<b>": average}`` of one run (a single batch size gets its `` B=``)."""
    report = json.loads((folder / "results.json").read_text())
    sizes = report["spec"]["batch_sizes"] or [report["spec"]["batch_size"]]
    out = {}
    for name, result in report["results"].items():
        key = name if " B=" in name else f"{name} B={sizes[0]}"
        out[key] = result["average"]
    return out


def main(root: Path) -> str:
    lines = ["| model | B | NoAdapt | EVA-0 | source-free (eva0-dagger) | gain | share of "
             "EVA-0's gain | eva0 on the set-up file | paper's EVA-0-dagger |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        shipped = _averages(root / f"{model}-continual")
        free = _averages(root / f"{model}-continual-source-free")
        paper = _averages(root / f"{model}-continual-paper-dagger")
        for b in (1, 16, 64):
            base, eva0, sf = shipped[f"noadapt B={b}"], shipped[f"eva0 B={b}"], \
                free[f"eva0-dagger B={b}"]
            share = (sf - base) / (eva0 - base) if eva0 != base else float("nan")
            old = paper.get(f"eva0-dagger B={b}")
            lines.append(
                f"| {model} | {b} | {base:.1f} | {eva0:.1f} | {sf:.1f} | {sf - base:+.1f} | "
                f"{100 * share:.0f}% | {free[f'eva0 B={b}']:.1f} | "
                f"{'' if old is None else f'{old:.1f}'} |")
    lines += ["", "| model | B | NoAdapt | EVA-0 | source-free (eva0-dagger) | "
              "eva0 on the set-up file |", "|---|---|---|---|---|---|"]
    for model in MODELS:
        shipped = _averages(root / f"{model}-clean")
        free = _averages(root / f"{model}-clean-source-free")
        for b in (1, 4, 16, 64):
            lines.append(f"| {model} | {b} | {shipped[f'noadapt B={b}']:.1f} | "
                         f"{shipped[f'eva0 B={b}']:.1f} | {free[f'eva0-dagger B={b}']:.1f} | "
                         f"{free[f'eva0 B={b}']:.1f} |")
    text = "\n".join(lines) + "\n"
    (root / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/source-free")))
