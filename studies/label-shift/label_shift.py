"""The activation shift's label-shift correction on and off (``shift_prior_window`` 1024 against
None), per model, protocol and severity: the product's ``eval`` on the validation split (class
runs of 100 images in ``imbalanced`` at 1000 images per corruption; ``single`` and ``continual``
at 500), the methods given (default: NoAdapt, the one-forward tier and EVA-0), batch 16; and
the tuning grid of the window (the tier alone at ``shift_prior_window`` 512 and 2048).

    python studies/label-shift/label_shift.py --out results/label-shift \
        --models mobilenet_bn_fmnist,vit_fmnist,resnet_gn_fmnist

Appends one line per model, protocol, severity, method and setting to ``label-shift.jsonl``
(a cell already there is not run again; several runs may share one ``--out``, each with its
own ``--models``) and writes ``label-shift.md`` from every line there: each cell's accuracy and
forwards per sample, and per model and protocol the mean gain over NoAdapt and the worst cell.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

SETTINGS = {"off": "None", "on": "1024", "window-512": "512", "window-2048": "2048"}
GRID_METHODS = "noadapt-shift"  # what the window's grid settings run
LIMITS = {"imbalanced": 1000, "single": 500, "continual": 500}


def run_cell(model: str, protocol: str, severities: str, methods: str, setting: str,
             batch: int) -> dict:
    """One ``eval`` run; its results.json's ``results``."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([
            sys.executable, "-m", "eva0_edge", "eval", "--model", f"models/{model}.onnx",
            "--protocol", protocol, "--severity", severities, "--split", "val",
            "--limit", str(LIMITS[protocol]), "--batch-size", str(batch), "--threads", "1",
            "--methods", methods, "--set", f"shift_prior_window={SETTINGS[setting]}",
            "--out", out, "-q"], check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(out) / "results.json").read_text())["results"]


def _cell(value: float | None, form: str = "{:.2f}") -> str:
    return "-" if value is None else form.format(value)


def summary(rows: list[dict]) -> str:
    """The markdown tables of ``rows``: every cell per setting, then per model, protocol and
    method the mean gain over NoAdapt and the worst cell's, per setting."""
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in rows)]
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        cells[(r["model"], r["protocol"], r["severity"], r["method"])][r["setting"]] = r
    head = " | ".join(settings)
    lines = ["Accuracy (%) per setting of `shift_prior_window` (off = None, on = 1024), and "
             "the forwards per sample with it on:", "",
             f"| model | protocol | severity | method | {head} | forwards on |",
             "|---|---|---|---|" + "---|" * (len(settings) + 1)]
    for (model, protocol, severity, method), by in sorted(cells.items()):
        accuracy = " | ".join(_cell(by.get(s, {}).get("accuracy")) for s in settings)
        lines.append(f"| {model} | {protocol} | {severity} | {method} | {accuracy} | "
                     f"{_cell(by.get('on', {}).get('forwards'))} |")
    base = {(r["model"], r["protocol"], r["severity"]): r["accuracy"] for r in rows
            if r["method"] == "noadapt"}
    gains: dict[tuple, list] = defaultdict(list)
    for r in rows:
        key = (r["model"], r["protocol"], r["severity"])
        if r["method"] != "noadapt" and key in base:
            gains[(*key[:2], r["method"], r["setting"])].append(r["accuracy"] - base[key])
    lines += ["", "Gain over NoAdapt (points): mean over the severities run / worst severity:",
              "", f"| model | protocol | method | {head} |",
              "|---|---|---|" + "---|" * len(settings)]
    for model, protocol, method in sorted({k[:3] for k in gains}):
        by = [gains.get((model, protocol, method, s)) for s in settings]
        lines.append(f"| {model} | {protocol} | {method} | " + " | ".join(
            "-" if g is None else f"{np.mean(g):+.2f} / {min(g):+.2f}" for g in by) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_bn_fmnist,vit_fmnist,resnet_gn_fmnist")
    parser.add_argument("--protocols", default="imbalanced,single,continual")
    parser.add_argument("--severities", default="1,3,5")
    parser.add_argument("--methods", default="noadapt,noadapt-shift,eva0",
                        help="what the off and on settings run")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"of {', '.join(SETTINGS)}; the window's grid settings run "
                             f"{GRID_METHODS} alone")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "label-shift.jsonl"

    def read() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    done = {(r["model"], r["protocol"], r["setting"], r["method"]) for r in read()}
    for model in args.models.split(","):
        for setting in args.settings.split(","):
            for protocol in args.protocols.split(","):
                wanted = args.methods if setting in ("off", "on") else GRID_METHODS
                methods = [m for m in wanted.split(",")
                           if (model, protocol, setting, m) not in done
                           and not (m == "noadapt" and setting != "off")]  # no shift to correct
                if not methods:
                    continue
                results = run_cell(model, protocol, args.severities, ",".join(methods), setting,
                                   args.batch)
                with path.open("a") as out:
                    out.write("".join(json.dumps({
                        "model": model, "protocol": protocol, "severity": int(key.split(" S=")[1]),
                        "method": key.split(" S=")[0], "setting": setting, "batch": args.batch,
                        "accuracy": value["average"], "forwards": value["forwards_per_sample"],
                    }) + "\n" for key, value in results.items()))
                print(f"{model} {protocol} {setting}: {','.join(methods)}", flush=True)
    (args.out / "label-shift.md").write_text(summary(read()))
    print(summary(read()))


if __name__ == "__main__":
    main()
