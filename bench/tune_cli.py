"""``eva0-edge tune``: the tuning rule of ``models/recipes/tune.py`` on the user's own labelled
images (needs the [bench] extra for the torch baselines, the [calibrate] extra for the
corruptions)."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from eva0_edge.bench.cli import quiet_routine_warnings, severity_list
from eva0_edge.bench.testbed.protocols import PROTOCOLS, SEVERITIES
from eva0_edge.runtime.cli import int_in, int_list, missing_extra, split_names
from eva0_edge.runtime.config import parse_key_values

REFIT_CLEAN = 1000  # clean images of the guard's refit (calibrate's --fit-clean default)


class Echo:
    """Prints, after the first configuration, how long one took and about how long is left."""

    def __init__(self, configs: int) -> None:
        self.configs = configs
        self.start = time.monotonic()
        self.scored = -1  # the NoAdapt reference comes first

    def __call__(self, row: dict[str, Any]) -> None:
        self.scored += 1
        if self.scored == 1:
            took = time.monotonic() - self.start
            print(f"1 of {self.configs} configurations scored in {took / 60:.1f} min; about "
                  f"{took * (self.configs - 1) / 60:.0f} min left (more if the best lies past "
                  "the grid's edge)", flush=True)


def _cmd_tune(args: argparse.Namespace) -> None:
    try:
        from eva0_edge.bench.testbed.tuner import (
            TuneSettings,
            default_grid,
            run_tuning,
            write_choice,
        )
        from eva0_edge.bench.testbed.tuning import parse_grid
        from eva0_edge.bench.testbed.userdata import labelled_images
    except ImportError as err:
        raise missing_extra("tune", "bench", err) from err
    from eva0_edge.runtime.modelfile import read_metadata

    quiet_routine_warnings(args.verbose)
    metadata = read_metadata(args.model)
    images, labels, skipped = labelled_images(args.data, metadata, args.labels,
                                              progress=not args.quiet)
    protocols = split_names(args.protocols)
    unknown = sorted(set(protocols) - set(PROTOCOLS))
    if unknown:
        raise ValueError(f"unknown protocol(s) {unknown} in --protocols; use {PROTOCOLS}")
    data = tune_data(images, labels, args, "gradual" in protocols)
    configs = parse_grid(args.grid) if args.grid else default_grid(args.model, args.method)
    settings = TuneSettings(
        batch_sizes=args.batch_sizes, protocols=protocols,
        clean_margin=args.clean_margin, fixed=parse_key_values(args.set or []),
        extend=args.extend, threads=args.threads)
    print(f"tuning {args.method} on {len(images)} labelled images"
          + (f" ({len(skipped)} undecodable skipped)" if skipped else "")
          + f": {len(configs)} configurations x {len(settings.protocols)} protocols x "
          f"batch sizes {settings.batch_sizes}, {len(fit_domains(data))} corruptions of "
          f"{len(data.corrupted[0])} images at severity {args.severity}"
          + (" (gradual: 1-5)" if "gradual" in protocols else "") + ", "
          f"{len(data.clean[0])} clean", flush=True)
    report = run_tuning(args.model, args.method, configs, data, settings,
                        progress=not args.quiet, echo=Echo(len(configs)))
    _say_best(args.method, report)
    chosen = dict(report["best"]["config"])
    shift_grid = [{"activation_shift": float(v)} for v in split_names(args.shift_grid)]
    if (args.method == "eva0" and shift_grid and "activation_shift" not in chosen
            and metadata.tuned.get("eva0", {}).get("activation_shift")):
        print(f"tuning the activation shift's strength under {chosen}: "
              f"{[c['activation_shift'] for c in shift_grid]}", flush=True)
        shift_settings = TuneSettings(**{**settings.__dict__, "extend": 0,
                                         "fixed": {**settings.fixed, **chosen}})
        report["shift"] = run_tuning(args.model, args.method, shift_grid, data,
                                     shift_settings, progress=not args.quiet,
                                     echo=Echo(len(shift_grid)), reference=report["noadapt"])
        _say_best(args.method, report["shift"])
        chosen.update(report["shift"]["best"]["config"])
    best = report.get("shift", report)["best"]
    log = Path(args.log) if args.log else Path(args.output or args.model).with_name(
        f"{Path(args.output or args.model).stem}.tune-{args.method}.json")
    log.write_text(json.dumps({"model": Path(args.model).name, "data": str(args.data),
                               "images": len(images), **report}, indent=2) + "\n")
    if args.output is None:
        print(f"log {log}; nothing written (give -o to store the values)")
        return
    if Path(args.output).resolve() != Path(args.model).resolve():
        shutil.copyfile(args.model, args.output)
    record = {"by": "tune", "images": len(images), "clean_images": len(data.clean[0]),
              "corruptions": len(fit_domains(data)), "severity": args.severity,
              "batch_sizes": settings.batch_sizes, "values": chosen,
              "eligible": best["eligible"]}
    write_choice(args.output, args.method, chosen, record)
    print(f"wrote {args.output}: {args.method} tuned to {chosen}; log {log}")
    if args.method == "eva0" and metadata.has_source_stats and args.refit:
        _refit_guard(args.output, images, data, args.seed)


def tune_data(images: Any, labels: Any, args: argparse.Namespace, gradual: bool) -> Any:
    """The tuning images (uint8 [N, H, W, 3], labels [N]) as :class:`.tuner.TuneData`: the
    clean ones and the corruptions at each of ``--severity``'s severities, and at every
    severity 1-5 when the protocols include ``gradual`` (the same images at each)."""
    from eva0_edge.bench.testbed.userdata import user_tune_data

    listed = [args.severity] if isinstance(args.severity, int) else list(args.severity)
    needed = sorted(set(listed) | (set(SEVERITIES) if gradual else set()))
    parts = [user_tune_data(images, labels, args.limit, args.clean_limit, severity, args.seed,
                  progress=not args.quiet) for severity in needed]
    data = parts[0]
    data.corrupted = [d for part in parts for d in part.corrupted]
    data.severity = args.severity
    return data


def fit_domains(data: Any) -> list[Any]:
    """The corrupted domains at the highest of the tuning's severities (one per corruption):
    what the guard's refit and the log's count read."""
    listed = [data.severity] if isinstance(data.severity, int) else list(data.severity)
    return [d for d in data.corrupted if d.severity == max(listed)]


def _say_best(method: str, report: dict[str, Any]) -> None:
    """One line: the rule's choice, its gains over NoAdapt on the corrupted cells (worst and
    best) and on the clean ones."""
    best = report["best"]
    gains = {k: v - report["noadapt"][k] for k, v in best["cells"].items()}
    corrupted = [v for k, v in gains.items() if not k.startswith("clean")]
    print(f"{method}: best {best['config']}: corrupted {min(corrupted):+.2f} (worst cell) .. "
          f"{max(corrupted):+.2f} over NoAdapt, worst corrupted cell "
          f"{best['worst_corrupted']:.2f}%; clean "
          + ", ".join(f"{k.split()[1]} {v:+.2f}" for k, v in gains.items()
                      if k.startswith("clean"))
          + ("" if best["eligible"] else " (no configuration kept clean within the margin)"),
          flush=True)


def _refit_guard(output: str, images: Any, data: Any, seed: int) -> None:
    """The guard's drift bound depends on the rates: fit it again under the tuned values, on
    up to :data:`REFIT_CLEAN` of the clean images (as ``calibrate``) and the corrupted ones."""
    import numpy as np

    from eva0_edge.runtime.fitting import fit_safety, write_fit

    if len(images) > REFIT_CLEAN:
        chosen = np.random.default_rng(seed).choice(len(images), REFIT_CLEAN, replace=False)
        images = images[np.sort(chosen)]
    domains = fit_domains(data)
    fit = fit_safety(output, images, {d.name: d.images for d in domains}, domains[0].severity)
    write_fit(output, output, fit, "tune")
    print(f"refitted the health guard under the tuned rates ({len(fit.bounds)} bounds, drift "
          f"at most {fit.bounds['guard_drift_max']:g})")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``tune`` on the dispatcher's subparsers."""
    p = sub.add_parser("tune", help="tune a method's rates on your labelled images by the "
                       "project's rule (worst cell over batch sizes and protocols, clean margin)")
    p.add_argument("--model", required=True, help="adaptable .onnx file (calibrated)")
    p.add_argument("--data", required=True, help="labelled clean validation images: a folder "
                   "of class sub-folders, a folder or .npy with --labels, or a .npz with labels")
    p.add_argument("--labels", metavar="CSV", help="image,label rows (label: a class name or "
                   "index; image: its path under --data, or its index in an array)")
    p.add_argument("-o", "--output", help="write the tuned model here (may equal --model); "
                   "without it nothing is written")
    p.add_argument("--method", default="eva0", help="default eva0 (any runtime method, or a "
                   "torch baseline: tent, sar, deyo, bn-adapt, bn-ema)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                   help="grid axis, repeatable (default: the step size x 0.5 .. 16)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a value every configuration runs with (not tuned)")
    p.add_argument("--limit", type=int_in(16), default=100,
                   help="images per corruption (default %(default)s)")
    p.add_argument("--clean-limit", type=int_in(16), default=500,
                   help="clean images (default %(default)s)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64],
                   help="default 1,4,16,64")
    p.add_argument("--protocols", default="single,continual",
                   help=f"corrupted protocols scored, of {', '.join(PROTOCOLS)} (default "
                   "%(default)s; gradual streams severities 1->5->1 by itself)")
    p.add_argument("--severity", type=severity_list, default=5, metavar="S",
                   help="corruption severity 1-5, or several (1-5, 1,3,5): a cell per "
                   "protocol, severity and batch size (default %(default)s)")
    p.add_argument("--clean-margin", type=float, default=0.5,
                   help="points a configuration may lose to NoAdapt on clean images "
                   "(default %(default)g)")
    p.add_argument("--shift-grid", default="0,1,1.5,2", metavar="S1,S2,...",
                   help="eva0 on a calibrated file: then the activation shift's strength, under "
                   "the chosen rates, by the same rule (default %(default)s; '' skips it)")
    p.add_argument("--extend", type=int_in(0), default=2, help="points scored past a grid "
                   "edge while the best sits on it (default %(default)s)")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=True,
                   help="eva0: fit the guard again under the tuned rates (default on)")
    p.add_argument("--seed", type=int, default=0, help="image choice seed")
    p.add_argument("--threads", type=int_in(1), default=1, help="ORT / torch threads "
                   "(default 1)")
    p.add_argument("--log", help="tuning log (default <output>.tune-<method>.json)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_tune)
