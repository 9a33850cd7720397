"""Where one adaptation step's host time goes: Python's profiler over timed steps.

    python studies/step-profile/step_profile.py --arch resnet50_gn --method eva0-split \
        --provider cuda --batch 32 --steps 20

Runs ``--steps`` steps of a cost method (``eva0``, ``eva0-split``, ``zoa``, ...; see
``eva0-edge bench``) after a warm-up on random pixels, under :mod:`cProfile`, and prints the
milliseconds per step of the whole step, of ORT's calls (the session's own clock) and of the
functions that take the most time themselves (``tottime``). On a GPU the step's host part is
what ORT does not cover; this says which NumPy lines make it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from eva0_edge.bench.cost import make_step
from eva0_edge.bench.testbed.workload import export_random
from eva0_edge.runtime.cache import cache_dir


def profile_steps(
    model_path: str, method: str, batch: int, steps: int, provider: str, top: int,
    budget: float | None = None,
) -> str:
    """The report of ``steps`` profiled steps (after two warm-up steps) as text; ``budget``:
    the controller's settled schedule at that many forwards per sample (see ``bench``)."""
    made = make_step(method, model_path, batch, None, provider=provider, budget=budget)
    step, ort_seconds = made.run, made.ort_seconds
    for _ in range(2):
        step()
    ort_before = ort_seconds() if ort_seconds else 0.0
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    ort_ms = ((ort_seconds() if ort_seconds else 0.0) - ort_before) * 1e3 / steps
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(top)
    label = method if budget is None else f"{method} budget {budget:g}"
    head = (f"{label} B={batch} on {provider}: {wall_ms:.2f} ms per step (profiled), "
            f"ORT {ort_ms:.2f} ms ({100 * ort_ms / wall_ms:.0f}%)\n")
    return head + text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="adaptable .onnx file (default: --arch, random weights)")
    parser.add_argument("--arch", default="resnet50_gn")
    parser.add_argument("--method", default="eva0")
    parser.add_argument("--provider", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    parser.add_argument("--budget", type=float, help="compute budget, forwards per sample")
    args = parser.parse_args(argv)
    path = args.model or str(export_random(args.arch, cache_dir() / "bench-models"))
    print(profile_steps(path, args.method, args.batch, args.steps, args.provider, args.top,
                        args.budget))


if __name__ == "__main__":
    main()
