"""The paper's black-box study (its Table 6): prompt-only adaptation at #FP forwards per sample,
FOA-dagger against EVA-0-clubs, single-domain, averaged over the 15 corruptions.

    python -m eva0_edge.bench.blackbox --model models/vit_fmnist.onnx --fps 2,8,14,20,26 \\
        --limit 1000 --out out/blackbox

Every method runs on the model's prompt variant (``--prompt-model``, or derived for a shipped
model); NoAdapt on the model itself and on the prompt variant (initial prompt) are the
references. Writes ``blackbox.md`` / ``.json`` / ``.png`` and the per-corruption report of every
run (``results.md`` / ``.json``, ``stream.png``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from eva0_edge.runtime.session import SessionSettings

from .testbed.evaluate import EvalSpec, evaluate, model_for, spec_dict
from .testbed.machine import environment
from .testbed.output import machine_line, pyplot, save_figure, write_outputs
from .testbed.report import write_report

METHODS = ("foa-dagger", "eva0-clubs")
FORWARDS = (2, 8, 14, 20, 26)


def run_blackbox(
    model: str,
    fps: list[int],
    methods: list[str],
    severity: int = 5,
    limit: int | None = None,
    batch_size: int = 64,
    seed: int = 0,
    threads: int | None = None,
    prompt_model: str | None = None,
    out_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy (mean over corruptions, %) of each method at each #FP, with the references."""
    spec = EvalSpec(
        model=model, dataset="fmnist-c", protocol="single", severity=severity,
        batch_size=batch_size, seed=seed, limit=limit,
        session=SessionSettings(provider="cpu", threads=threads),
        prompt_model=prompt_model,
        methods=["noadapt", *[f"{m}@{fp}" for m in methods for fp in fps]],
    )
    start = environment()
    results = evaluate(spec, progress=progress)
    prompt_path = model_for(spec, "eva0-clubs")
    reference = evaluate(
        EvalSpec(**{**spec.__dict__, "model": prompt_path, "methods": ["noadapt"]}),
        progress=progress,
    )["noadapt"]
    if out_dir is not None:
        write_report({**results, "noadapt (prompt model)": reference},
                     {**spec_dict(spec), "prompt_model": Path(prompt_path).name}, out_dir)
    return {
        "model": Path(model).name,
        "prompt_model": Path(prompt_path).name,
        "severity": severity, "limit": limit, "batch_size": batch_size, "seed": seed,
        "threads": threads or "ort default",
        "fps": fps,
        "noadapt": results["noadapt"].average,
        "noadapt_prompt_model": reference.average,
        "accuracy": {m: {str(fp): results[f"{m}@{fp}"].average for fp in fps} for m in methods},
        "forwards_per_sample": {
            m: {str(fp): results[f"{m}@{fp}"].forwards_per_sample for fp in fps} for m in methods
        },
        "environment_start": start,
        "environment_end": environment(),
    }


def markdown(report: dict[str, Any]) -> str:
    fps = report["fps"]
    lines = [
        f"## Black-box prompt adaptation: {report['model']} (severity {report['severity']}, "
        f"{report['limit'] or 'all'} images per corruption, batch {report['batch_size']})",
        "",
        machine_line(report),
        "",
        "| method | " + " | ".join(f"#FP={fp}" for fp in fps) + " |",
        "|---|" + "---|" * len(fps),
    ]
    for method, row in report["accuracy"].items():
        lines.append(f"| {method} | " + " | ".join(f"{row[str(fp)]:.1f}" for fp in fps) + " |")
    lines += [
        "",
        f"NoAdapt: {report['noadapt']:.1f} (source model), "
        f"{report['noadapt_prompt_model']:.1f} (prompt model, initial prompt).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    fps = report["fps"]
    for method, row in report["accuracy"].items():
        ax.plot(fps, [row[str(fp)] for fp in fps], "o-", label=method)
    ax.axhline(report["noadapt"], color="grey", ls="--", lw=0.8, label="noadapt")
    ax.set_xlabel("#FP (forward passes per sample)")
    ax.set_ylabel("accuracy (%), mean of 15 corruptions")
    ax.set_xticks(fps)
    ax.legend(fontsize=8)
    ax.set_title(f"black-box prompt adaptation: {report['model']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="adaptable model (or its prompt model)")
    parser.add_argument("--prompt-model", help="prompt model (default: derived, shipped models)")
    parser.add_argument("--fps", default=",".join(map(str, FORWARDS)), help="#FP values")
    parser.add_argument("--methods", default=",".join(METHODS), help="prompt methods")
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--limit", type=int, help="images per corruption (a seeded subset)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="ORT intra-op threads")
    parser.add_argument("--out", default="out/blackbox", help="output folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = run_blackbox(
        args.model, [int(v) for v in args.fps.split(",")], args.methods.split(","),
        args.severity, args.limit, args.batch_size, args.seed, args.threads, args.prompt_model,
        out, progress=True,
    )
    write_outputs(out, "blackbox", report, markdown(report), plot)
    print(markdown(report))
    print(f"report: {os.path.join(args.out, 'blackbox.md')}, blackbox.json, blackbox.png")


if __name__ == "__main__":
    main()
