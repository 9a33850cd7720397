"""Where to adapt (``make layers``): what adapting fewer stages costs and what it keeps.

    python -m eva0_edge.bench.layers_summary out/layers

Reads ``<reports>/bench-<arch>-<set>/cost.json`` (ResNet50-GN and ViT-B with random weights: EVA-0's
step against NoAdapt's per batch size) and ``<reports>/acc-<model>-<protocol>/results.json``
(the shipped ResNet-GN and ViT re-exported per stage or block set, rates tuned by the rule:
average accuracy over the 15 corruptions, EVA-0's gain over NoAdapt and its share of the gain of
the file of the same architecture that adapts the most parameters). Prints both tables and
writes ``<reports>/layers.md``, ``layers.json`` and ``layers.png`` (cost per stage or block set
and model; share of the gain per set and architecture).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..runtime.modelfile import read_metadata
from .testbed.output import pyplot, save_figure, write_outputs


def cost_rows(reports: Path) -> list[dict[str, Any]]:
    """One row per (stage set, batch size): EVA-0's ms per sample over NoAdapt's."""
    rows = []
    for path in sorted(reports.glob("bench-*/cost.json")):
        report = json.loads(path.read_text())
        for row in report["rows"]:
            if row["method"] == "eva0":
                arch = report["architecture"]
                rows.append({"model": arch,
                             "stages": path.parent.name.removeprefix(f"bench-{arch}-"),
                             "batch_size": row["batch"],
                             "ratio_to_noadapt": round(row["ratio_to_noadapt"], 3)})
    return sorted(rows, key=lambda r: (r["model"], r["batch_size"], r["ratio_to_noadapt"]))


def accuracy_rows(reports: Path, model_dirs: list[Path]) -> list[dict[str, Any]]:
    """One row per (file, protocol, batch size): NoAdapt's, noadapt-shift's (None when the
    report has no such row) and EVA-0's averages (%); EVA-0's gain over NoAdapt and over
    noadapt-shift (what its update adds to the one-forward shift), each with its share of the
    same gain of the file of the same architecture (the metadata's) with the most adapted
    parameters. The model files (named in the reports) are looked up in ``model_dirs``."""
    rows = []
    for path in sorted(reports.glob("acc-*/results.json")):
        report = json.loads(path.read_text())
        spec = report["spec"]
        found = [d / Path(spec["model"]).name for d in model_dirs
                 if (d / Path(spec["model"]).name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: model {spec['model']} is in none of "
                                    f"{', '.join(map(str, model_dirs))}")
        metadata = read_metadata(found[0])
        for batch in sorted({r["batch_size"] for r in report["results"].values()}):
            noadapt = report["results"][f"noadapt B={batch}"]["average"]
            eva0 = report["results"][f"eva0 B={batch}"]["average"]
            shift = report["results"].get(f"noadapt-shift B={batch}", {}).get("average")
            rows.append({"model": Path(spec["model"]).stem,
                         "architecture": metadata.architecture, "stages": metadata.adapt,
                         "parameters": metadata.num_params, "protocol": spec["protocol"],
                         "batch_size": batch, "noadapt": round(noadapt, 2),
                         "noadapt_shift": None if shift is None else round(shift, 2),
                         "eva0": round(eva0, 2), "gain": round(eva0 - noadapt, 2),
                         "gain_over_shift": None if shift is None else round(eva0 - shift, 2)})
    for row in rows:
        cell = [r for r in rows if (r["architecture"], r["protocol"], r["batch_size"]) ==
                (row["architecture"], row["protocol"], row["batch_size"])]
        full = max(cell, key=lambda r: r["parameters"])
        row["share_of_gain"] = _share(row["gain"], full["gain"])
        row["share_over_shift"] = _share(row["gain_over_shift"], full["gain_over_shift"])
    return sorted(rows, key=lambda r: (r["architecture"], r["protocol"], r["batch_size"],
                                       -r["parameters"]))


def _share(gain: float | None, full: float | None) -> float | None:
    """``gain`` as a share of ``full`` (None when either is missing or ``full`` is no gain)."""
    if gain is None or full is None or full <= 0:
        return None
    return round(gain / full, 3)


def markdown(costs: list[dict[str, Any]], accuracy: list[dict[str, Any]]) -> str:
    """The cost table and the accuracy table (each only when it has rows)."""
    tables = []
    if costs:
        lines = ["| model | stages | B | EVA-0 x NoAdapt |", "|---" * 4 + "|"]
        lines += [f"| {r['model']} | {r['stages']} | {r['batch_size']} | "
                  f"{r['ratio_to_noadapt']:.2f} |" for r in costs]
        tables.append("\n".join(lines))
    if accuracy:
        lines = ["| model | stages | theta | protocol | B | NoAdapt | noadapt-shift | EVA-0 | "
                 "gain | share | over shift | share |", "|---" * 12 + "|"]
        for r in accuracy:
            lines.append(
                f"| {r['model']} | {r['stages']} | {r['parameters']} | {r['protocol']} | "
                f"{r['batch_size']} | {r['noadapt']:.2f} | {_cell(r['noadapt_shift'], '.2f')} | "
                f"{r['eva0']:.2f} | {r['gain']:+.2f} | {_percent(r['share_of_gain'])} | "
                f"{_cell(r['gain_over_shift'], '+.2f')} | {_percent(r['share_over_shift'])} |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    models = sorted({r["model"] for r in report["costs"]})
    archs = sorted({r["architecture"] for r in report["accuracy"]})
    panels = len(models) + len(archs)
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for batch in sorted({r["batch_size"] for r in report["costs"] if r["model"] == model}):
            mine = [r for r in report["costs"] if (r["model"], r["batch_size"]) == (model, batch)]
            ax.plot([r["stages"] for r in mine], [r["ratio_to_noadapt"] for r in mine],
                    marker="o", label=f"B = {batch}")
        ax.set_title(f"{model} step cost (random weights)", fontsize=9)
        ax.set_xlabel("adapted stages / blocks")
        ax.set_ylabel("EVA-0 time / NoAdapt time")
    for ax, arch in zip(axes[0][len(models):], archs, strict=True):
        accuracy = [r for r in report["accuracy"] if r["architecture"] == arch]
        for cell in sorted({(r["protocol"], r["batch_size"]) for r in accuracy}):
            mine = [r for r in accuracy if (r["protocol"], r["batch_size"]) == cell
                    and r["share_of_gain"] is not None]
            ax.plot([r["stages"] for r in mine], [100 * r["share_of_gain"] for r in mine],
                    marker="o", label=f"{cell[0]}, B = {cell[1]}")
        ax.set_title(f"shipped {arch}: share of EVA-0's gain", fontsize=9)
        ax.set_xlabel("adapted stages / blocks")
        ax.set_ylabel("% of the largest set's gain")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, help="folder of bench-*/ and acc-*/ reports")
    parser.add_argument("--model-dirs", type=Path, nargs="+", default=None,
                        help="where the evaluated files are (default: the reports folder and "
                             "models/)")
    args = parser.parse_args(argv)
    model_dirs = args.model_dirs or [args.reports, Path("models")]
    costs, accuracy = cost_rows(args.reports), accuracy_rows(args.reports, model_dirs)
    if not costs and not accuracy:
        parser.error(f"no bench-*/cost.json or acc-*/results.json under {args.reports}")
    table = markdown(costs, accuracy)
    print(table)
    write_outputs(args.reports, "layers", {"costs": costs, "accuracy": accuracy}, table + "\n",
                  plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
