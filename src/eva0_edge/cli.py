"""The ``eva0-edge`` command line: one dispatcher, each package owning its subcommands.

``export`` (:mod:`eva0_edge.exporter.cli`), ``info`` / ``calibrate`` / ``adapt`` / ``serve``
(:mod:`eva0_edge.runtime.cli`), ``quantize`` (:mod:`eva0_edge.quant.cli`), ``eval`` / ``bench``
(:mod:`eva0_edge.bench.cli`), ``tune`` (:mod:`eva0_edge.bench.tune_cli`). Subcommands that need
torch or the benchmark extras import them when they run, so the device subcommands work on an
install without them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from eva0_edge import __version__
from eva0_edge.bench.cli import add_commands as add_bench_commands
from eva0_edge.bench.tune_cli import add_command as add_tune_command
from eva0_edge.exporter.cli import add_commands as add_export_commands
from eva0_edge.quant.cli import add_commands as add_quant_commands
from eva0_edge.runtime.cli import add_commands as add_runtime_commands
from eva0_edge.runtime.metadata import ModelFormatError
from eva0_edge.runtime.session import InputError
from eva0_edge.runtime.state import StateError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eva0-edge",
        description="Backprop-free test-time adaptation (EVA-0) on ONNX Runtime.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv: debug); tracebacks of unexpected errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in (add_export_commands, add_runtime_commands, add_quant_commands,
                         add_bench_commands, add_tune_command):
        add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``eva0-edge`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
    )
    name = f"eva0-edge {args.command}"
    try:
        args.func(args)
    except (FileNotFoundError, ModelFormatError, InputError, StateError, ValueError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`eva0-edge info m.onnx | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        if args.verbose:
            raise
        print(f"{name}: error: {type(err).__name__}: {err} (rerun with -v for the traceback)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
