"""The device subcommands of ``eva0-edge``: ``info``, ``calibrate``, ``adapt``, ``serve``,
``top``, and the argparse helpers the tool packages' subcommands share. The dispatcher is
:mod:`eva0_edge.cli`; nothing here imports torch or the tool packages (exporter, quant, bench).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from .config import parse_key_values
from .registry import RUNTIME_KINDS, method_help

if TYPE_CHECKING:
    from .policy import Policy
    from .server import ServeOptions
    from .session import SessionSettings

log = logging.getLogger("eva0_edge")

PROVIDER_HELP = "ONNX Runtime provider (default auto: CUDA when onnxruntime-gpu sees a GPU)"
IO_BINDING_HELP = (
    "run ORT through IOBinding: outputs into buffers reused from step to step (on CUDA the "
    "inputs into reused device buffers, split sessions' activations kept on the GPU; "
    "default: on for CUDA, off for the CPU)"
)
DEVICE_STEP_HELP = (
    "on CUDA, keep the batch and the step's arrays on the GPU (CuPy, eva0-edge[gpu]): the input "
    "check, the perturbations (Philox), the theta rows, the losses and the gradient there; "
    "--no-device-step runs them on the host with the CPU's numbers (default: on where CuPy "
    "sees the GPU)"
)
LOW_MEMORY_HELP = (
    "run the +/- copies as two ORT calls: peak memory of plain inference, the shared prefix "
    "computed twice"
)


def missing_extra(command: str, extra: str, err: ImportError) -> SystemExit:
    """The exit for a subcommand whose optional dependencies are not installed."""
    return SystemExit(
        f"{command} needs the [{extra}] extra: pip install 'eva0-edge[{extra}]' ({err})"
    )


BUDGET_HELP = ("average forwards per sample adaptation may spend, 1 (the activation shift "
               "alone) to the method's own (default: adapt on every batch); spent densely "
               "after a change of stream")


def method_overrides(args: argparse.Namespace) -> dict:
    """The hyper-parameter overrides of ``--set`` and ``--budget``."""
    overrides = parse_key_values(args.set or [])
    if getattr(args, "budget", None) is not None:
        overrides["budget"] = args.budget
    return overrides


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound when None), else a usage
    error naming the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value
    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: ``"1,8,32"`` -> [1, 8, 32], each >= 1."""
    values = [int_in(1)(part) for part in split_names(text)]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value, e.g. 1,8,32")
    return values


def budget_list(text: str) -> list[float]:
    """An argparse type: ``"1.25,1.5"`` -> [1.25, 1.5], compute budgets in forwards per
    sample, each finite and >= 1 (the method's own forwards are its upper bound)."""
    values = []
    for part in split_names(text):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not 1.0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"a budget must be >= 1 forward per sample, "
                                             f"got {part}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("give at least one budget, e.g. 1.25,1.5")
    return values


def split_names(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def add_runtime_options(p: argparse.ArgumentParser, *, method: bool = True) -> None:
    """Options that mean the same in every subcommand."""
    if method:
        p.add_argument("--seed", type=int, default=0, help="perturbation seed (default 0)")
        p.add_argument(
            "--set", action="append", metavar="KEY=VALUE",
            help="hyper-parameter override, repeatable: --set eta=0.001 --set lambda_swa=0",
        )
        p.add_argument("--budget", type=float, metavar="F", help=BUDGET_HELP)
    p.add_argument("--batch-size", type=int_in(1), default=64, help="default 64")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"],
                   help=PROVIDER_HELP)
    if method:
        p.add_argument("--io-binding", action=argparse.BooleanOptionalAction,
                       help=IO_BINDING_HELP)
        p.add_argument("--device-step", action=argparse.BooleanOptionalAction,
                       help=DEVICE_STEP_HELP)
        add_split_options(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add_split_options(p: argparse.ArgumentParser) -> None:
    """--split-sessions and --memory-budget-mb (see ``AdaptableSession``)."""
    p.add_argument(
        "--split-sessions", action=argparse.BooleanOptionalAction,
        help="run the shared prefix once and the adapted suffix per theta copy, as two ORT "
        "sessions, the parts cached on first use (default: on unless --low-memory)",
    )
    p.add_argument(
        "--memory-budget-mb", type=float,
        help="with --split-sessions: MiB of suffix activations one call may hold, at least "
        "the batch's rows (default 16: a small model's copies in one call, a large model's "
        "one copy per call)",
    )


def session_settings(args: argparse.Namespace) -> SessionSettings:
    """How ORT runs the model, from a subcommand's options (built once, passed whole; an
    option the subcommand does not have takes the default)."""
    from .session import SessionSettings

    return SessionSettings(
        provider=args.provider, threads=getattr(args, "threads", None),
        low_memory=getattr(args, "low_memory", False),
        io_binding=getattr(args, "io_binding", None),
        split=getattr(args, "split_sessions", None),
        memory_budget_mb=getattr(args, "memory_budget_mb", None),
        device_step=getattr(args, "device_step", None),
    )


class StopRequest:
    """Within its block, SIGINT and SIGTERM ask the loop to stop after the batch in progress
    (``signal`` names the one received) instead of killing it mid-write; a second one
    interrupts at once."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        import signal

        def ask(number: int, _frame: Any) -> None:
            if self.signal is not None:
                raise KeyboardInterrupt
            self.signal = signal.Signals(number).name

        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, ask)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _runtime_method(name: str) -> str:
    """argparse type of --method on adapt / serve: any runtime method (FOA included), @FP
    allowed."""
    from .methods import base_name

    try:
        base_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return name


RUNTIME_METHOD_HELP = method_help(*RUNTIME_KINDS)


def _cmd_info(args: argparse.Namespace) -> None:
    from .info import describe
    from .modelfile import read_metadata

    if (args.model is None) == (args.model_option is None):
        raise ValueError("info takes one model: `eva0-edge info m.onnx` or `--model m.onnx`")
    print(describe(read_metadata(args.model or args.model_option), full=args.full))


def _cmd_calibrate(args: argparse.Namespace) -> None:
    from .calibrate import source_statistics, write_source_stats
    from .data import open_input
    from .modelfile import read_metadata
    from .session import AdaptableSession
    from .sourcefree import setup_source_free

    if args.data is None:  # no clean images: the source-free mode
        print(setup_source_free(args.model, args.output))
        return
    metadata = read_metadata(args.model)
    session = AdaptableSession(args.model, metadata, args.provider, threads=args.threads)
    stream = open_input(args.data, metadata.preprocessing)
    stats = source_statistics(session, stream, args.batch_size, progress=not args.quiet,
                              skip_bad=True)
    write_source_stats(args.model, args.output, stats["source_mean"], stats["source_std"],
                       stats.get("head_input_mean"), stats.get("head_input_class_means"))
    used = len(stream) - len(stream.skipped)
    print(f"wrote {args.output}: source statistics of {metadata.num_features} features "
          f"from {used} images" + stream.skipped_summary())
    if args.fit and metadata.is_prompt_model:
        print("guard and shift not fitted: they watch EVA-0's norm affines, and this is a "
              "black-box prompt model")
    elif args.fit:
        _fit_safety(args, stream)


def _fit_safety(args: argparse.Namespace, stream: Any) -> None:
    """``calibrate``'s second part: the guard's and the shift's bounds fitted on the clean
    images and the testbed's corruptions of them, written into ``args.output``."""
    import json

    from .calibrate import sample_pixels
    from .fitting import fit_log, fit_safety, write_fit
    from .progress import progress_bar

    try:
        from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_any
    except ImportError as err:
        raise missing_extra("calibrate (fitting the guard and the shift; --no-fit skips it)",
                            "calibrate", err) from err
    clean, base = sample_pixels(stream, [(args.fit_clean, args.seed),
                                         (args.fit_limit, args.seed + 1)])
    corrupted = {name: corrupt_any(base, name, args.severity, args.seed)
                 for name in progress_bar(CORRUPTIONS, total=len(CORRUPTIONS), desc="corrupt",
                                          unit="corruption", quiet=args.quiet)}
    fit = fit_safety(args.output, clean, corrupted, args.severity, threads=args.threads,
                     progress=not args.quiet)
    write_fit(args.output, args.output, fit, "calibrate")
    if args.fit_log:
        from .atomic import atomic_write_bytes

        atomic_write_bytes(args.fit_log, (json.dumps(fit_log(fit, args.output), indent=2)
                                          + "\n").encode())
    shift = (f"activation shift on (strength {fit.shift['activation_shift']:g}, bound "
             f"{fit.shift_max:g})" if fit.shift_max is not None else
             f"activation shift off ({fit.shift_off_reason})")
    print(f"fitted on {len(clean)} clean images and {len(corrupted)} corruptions of {len(base)} "
          f"(severity {args.severity}): health guard on ({len(fit.bounds)} bounds), {shift}")


def warn_unfitted(model: Policy, overrides: dict[str, Any]) -> None:
    """One warning line when EVA-0 runs on a model whose guard or rates were never fitted
    (:func:`.info.unfitted_warning`)."""
    from .info import unfitted_warning

    line = unfitted_warning(model.metadata, model.method, overrides)
    if line:
        log.warning("%s", line)


def _cmd_adapt(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .data import open_input
    from .methods import load_method
    from .predictions import PredictionWriter
    from .progress import progress_bar

    model = load_method(args.model, args.method, method_overrides(args), args.seed,
                        session_settings(args))
    warn_unfitted(model, method_overrides(args))
    if not model.spec.keeps_state:
        if args.state:
            raise ValueError(
                f"--state: {args.method}'s CMA-ES search state cannot be saved or resumed yet; "
                "run it without --state"
            )
    elif args.state and Path(args.state).is_file():
        model.load_state(args.state)
    before = model.stats()  # a resumed state counts its earlier steps; the summary: this run's
    stream = open_input(args.input, model.metadata.preprocessing)
    correct = seen = 0
    failure: Exception | None = None
    with PredictionWriter(args.output, model.metadata.labels, args.logits) as writer, \
            StopRequest() as stop:
        progress = progress_bar(
            stream.batches(args.batch_size, skip_bad=args.on_bad_input == "skip"),
            total=-(-len(stream) // args.batch_size), desc=args.method, unit="batch",
            quiet=args.quiet,
        )
        try:
            for names, x, labels in progress:
                logits = model.step(x)
                writer.write(names, logits, labels)
                if labels is not None:
                    correct += int((logits.argmax(axis=1) == labels).sum())
                    seen += len(labels)
                    progress.set_postfix(acc=f"{100.0 * correct / seen:.2f}")
                if stop.signal is not None:
                    break
        except (ValueError, OSError) as err:  # a bad file in the stream (InputError included)
            failure = err
    if args.state and model.spec.keeps_state:
        model.save_state(args.state)
    stats = model.stats()
    resumed = (f"; resumed at step {before['steps']}, {stats['steps']} in the state"
               if before["steps"] else "")
    summary = (
        f"{args.method}: {stats['samples']} samples, {stats['steps'] - before['steps']} steps "
        f"({stats['skipped_steps'] - before['skipped_steps']} skipped{resumed}), "
        f"{stats['forwards_per_sample']:.2f} forwards/sample, drift {stats['drift']:.4g}"
    )
    if seen:
        summary += f", accuracy {100.0 * correct / seen:.2f}%"
    summary += stream.skipped_summary()
    stopped = f" (stopped by {stop.signal} after the batch in progress)" if stop.signal else ""
    print(summary + f" -> {args.output}" + (f", state {args.state}" if args.state else "")
          + stopped)
    if failure is not None:
        raise failure
    if stop.signal is not None:
        raise SystemExit(130)


def _cmd_serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .methods import load_method
    from .server import ServeOptions, run_server

    options = ServeOptions(  # range-checked here, before the model loads
        name=args.name or Path(args.model).stem,
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        adaptive_delay=not args.fixed_delay,
        asynchronous=args.async_adapt,
        state_dir=args.state_dir,
        snapshot_every=args.snapshot_every,
        keep_snapshots=args.keep_snapshots,
        max_body_mb=args.max_body_mb,
        summary_every_s=args.summary_every,
        max_pixels_mp=args.max_pixels_mp,
        admin_token=args.admin_token or os.environ.get("EVA0_ADMIN_TOKEN") or None,
        loopback=_is_loopback(args.host),
        header_timeout_s=args.header_timeout_s,
        host=args.host,
        replica=args.replica_id,
    )
    if args.replicas is not None and args.replica_id is not None:
        raise ValueError("--replica-id names a lone server behind a load balancer; with "
                         "--replicas each replica answers its own id")
    model = load_method(args.model, args.method, method_overrides(args), args.seed,
                        session_settings(args))
    warn_unfitted(model, method_overrides(args))
    level = "debug" if args.verbose >= 2 else "info"
    if args.replicas is None:
        run_server(model, options, args.host, args.port, level)
        return
    _serve_fleet(args, model, options, level)


def _serve_fleet(args: argparse.Namespace, model: Policy, options: ServeOptions,
                 level: str) -> None:
    """``serve --replicas N``: the fleet on Ray Serve (the ``[fleet]`` extra)."""
    import dataclasses

    if not model.spec.keeps_state:
        raise ValueError(f"--replicas: the fleet merges EVA-0-family states; {model.method} "
                         "keeps none (serve it without --replicas)")
    try:
        from eva0_edge.fleet.replica import ReplicaSpec
        from eva0_edge.fleet.serve import start_fleet
        from eva0_edge.fleet.state_actor import FleetConfig
    except ImportError as err:
        raise ValueError(
            f"--replicas needs Ray Serve: pip install 'eva0-edge[fleet]' ({err})"
        ) from err
    logging.getLogger("eva0_edge").setLevel(level.upper())
    spec = ReplicaSpec(args.model, args.method, dataclasses.replace(options, state_dir=None),
                       method_overrides(args), session_settings(args), args.sync_every_s,
                       args.seed)
    if args.sync_every_s < 0:
        raise ValueError(f"--sync-every-s must be >= 0, got {args.sync_every_s}")
    config = FleetConfig(threshold=args.fleet_threshold, combine=args.fleet_combine,
                         state_dir=args.state_dir,
                         keep=args.keep_snapshots, live_s=max(10.0, 5 * args.sync_every_s))
    from .server.runner import free_port, listening_url

    port = args.port or free_port(args.host)  # Ray Serve's proxy binds a port by number
    url = listening_url((args.host, port))
    log.info("the fleet will listen on %s (inference: POST %sv2/models/%s/infer) once its "
             "replicas answer", url, url, options.name)
    start_fleet(spec, args.replicas, config, args.host, port, args.ray_address, probe=model)


def _cmd_top(args: argparse.Namespace) -> None:
    from .top import run_top

    run_top(args.url, args.model, args.interval, args.once, args.history)


def _is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the device subcommands on the dispatcher's subparsers."""
    from .server.options import serve_defaults

    p = sub.add_parser("info", help="print an adaptable model's metadata")
    p.add_argument("model", nargs="?", help="adaptable .onnx file (or --model, as elsewhere)")
    p.add_argument("--model", dest="model_option", metavar="MODEL", help="adaptable .onnx file")
    p.add_argument("--full", action="store_true", help="list every theta segment")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("calibrate", help="add source feature statistics from clean images and "
                       "fit the health guard and the activation shift to them")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--data", help="clean images: folder, .npy or .npz (without: set the model "
                   "up for the source-free mode, no clean images used)")
    p.add_argument("-o", "--output", required=True, help="output .onnx (may equal --model)")
    p.add_argument("--fit", action=argparse.BooleanOptionalAction, default=True,
                   help="fit the guard's and the shift's bounds on the images and the testbed's "
                   "15 corruptions of them, and turn both on (default on; needs the "
                   "[calibrate] extra)")
    p.add_argument("--fit-clean", type=int_in(64), default=1000, metavar="N",
                   help="clean images the guard is fitted on (default %(default)s)")
    p.add_argument("--fit-limit", type=int_in(64), default=200, metavar="N",
                   help="images corrupted per corruption (default %(default)s)")
    p.add_argument("--severity", type=int_in(1, 5), default=5,
                   help="corruption severity of the fit (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="image choice and corruption seed")
    p.add_argument("--fit-log", metavar="JSON", help="write every signal's range and bound here")
    p.add_argument("--threads", type=int_in(1),
                   help="ORT intra-op threads (default: ORT's, one per core)")
    add_runtime_options(p, method=False)
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("adapt", help="predict and adapt over an offline stream")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--input", required=True, help="folder of images, .npy or .npz (the stream)")
    p.add_argument("-o", "--output", required=True, help="predictions .jsonl or .csv")
    p.add_argument("--logits", action="store_true", help="also write the logits")
    p.add_argument("--method", default="eva0", type=_runtime_method, help=RUNTIME_METHOD_HELP)
    p.add_argument("--state", help="state file: resumed from if it exists, saved at the end")
    p.add_argument("--on-bad-input", choices=["skip", "stop"], default="skip",
                   help="an image file that cannot be decoded: skip it (counted and named in "
                   "the summary) or stop there, keeping what was done (default skip)")
    p.add_argument("--low-memory", action="store_true", help=LOW_MEMORY_HELP)
    add_runtime_options(p)
    p.set_defaults(func=_cmd_adapt)

    serve = serve_defaults()
    p = sub.add_parser("serve", help="Open Inference Protocol server that adapts online")
    p.add_argument("--model", required=True, help="adaptable .onnx file")
    p.add_argument("--name", help="model name in the URLs (default: the file's stem)")
    p.add_argument("--host", default=serve["host"], help="bind address (default %(default)s)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="default 8000 (0: any free port)")
    p.add_argument("--method", default="eva0", type=_runtime_method, help=RUNTIME_METHOD_HELP)
    p.add_argument("--max-batch", type=int, default=serve["max_batch"],
                   help="most rows per adaptation step and per request (default %(default)s)")
    p.add_argument("--max-delay-ms", type=float, default=serve["max_delay_ms"],
                   help="how long a request waits for others to join its step "
                   "(default %(default)g)")
    p.add_argument("--state-dir", help="snapshot folder: resumed from at start, written to "
                   "every --snapshot-every steps and at shutdown")
    p.add_argument("--snapshot-every", type=int, default=serve["snapshot_every"],
                   help="steps (default %(default)s)")
    p.add_argument("--keep-snapshots", type=int, default=serve["keep_snapshots"],
                   help="newest kept (default %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=serve["max_body_mb"],
                   help="request limit (MiB, default %(default)g)")
    p.add_argument("--max-pixels-mp", type=float, default=serve["max_pixels_mp"],
                   help="decoded megapixels per 'images' request (default %(default)g: a 16 MP "
                   "RGBA PNG takes 128 MiB to decode and convert)")
    p.add_argument("--fixed-delay", action="store_true",
                   help="always let the oldest request wait up to --max-delay-ms for others "
                   "(default: wait only while more requests are being decoded)")
    p.add_argument("--async-adapt", action="store_true",
                   help="answer each request from one forward at the current theta as soon as "
                   "its batch has run, and adapt on recent answered inputs while idle, within "
                   "--budget (EVA-0 family)")
    p.add_argument("--header-timeout-s", type=float, default=serve["header_timeout_s"],
                   help="seconds a request's headers may take to arrive; later: 408 and the "
                   "connection closed (default %(default)g)")
    p.add_argument("--admin-token", help="bearer token of the admin endpoints (reset, PUT "
                   "state; default: $EVA0_ADMIN_TOKEN); without one they are refused off "
                   "loopback")
    p.add_argument("--replica-id", help="this server's name in its series (the dashboard, "
                   "top) where several serve one model behind one load balancer; the page "
                   "then charts each server apart (default: none, a lone server)")
    p.add_argument("--summary-every", type=float, default=serve["summary_every_s"],
                   help="seconds between info-level summaries (default %(default)g)")
    p.add_argument("--threads", type=int_in(1),
                   help="ORT intra-op threads (default: ORT's, one per core)")
    p.add_argument("--low-memory", action="store_true", help=LOW_MEMORY_HELP)
    p.add_argument("--io-binding", action=argparse.BooleanOptionalAction, help=IO_BINDING_HELP)
    add_split_options(p)
    p.add_argument("--seed", type=int, default=0, help="perturbation seed (default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="hyper-parameter override, repeatable")
    p.add_argument("--budget", type=float, metavar="F", help=BUDGET_HELP)
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"],
                   help=PROVIDER_HELP)
    p.add_argument("--replicas", type=int_in(1), help="serve N replicas on Ray Serve with merged "
                   "adaptation (the [fleet] extra); --state-dir then holds the fleet's snapshots")
    p.add_argument("--ray-address", help="join this Ray cluster (default: a local instance)")
    p.add_argument("--sync-every-s", type=float, default=2.0,
                   help="seconds between a replica's reports to the fleet state (default 2; 0: "
                   "no merging, every replica adapts alone)")
    p.add_argument("--fleet-threshold", type=float, default=1.0,
                   help="feature distance beyond which a replica is another domain and stays "
                   "out of the merge (default 1.0)")
    p.add_argument("--fleet-combine", default="mean", choices=["sum", "mean"],
                   help="a merge averages the replicas' steps weighted by their images (mean, "
                   "the default) or adds them (sum: lost 4.8 points on the continual stream "
                   "with 4 replicas, see the README)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("top", help="a running server's adaptation over time in the terminal "
                       "(the dashboard's series)")
    p.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    p.add_argument("--model", help="the served model's name (default: the one it serves)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between reads of the series (default %(default)g)")
    p.add_argument("--history", type=int_in(1, 3600), default=60, metavar="N",
                   help="points in each sparkline (default %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=_cmd_top)

