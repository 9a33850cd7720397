"""Mutation testing of the core numeric modules with mutmut (``make mutate``; not in CI).

mutmut imports the mutated code from ``mutants/src``, so the package is staged in the usual
``src/eva0_edge`` layout (the repository maps ``eva0_edge.runtime`` to ``runtime/`` and so on)
under ``build/mutate``; the unit tests run against it, each mutant in a process forked from a
server that has collected the tests but run none (ONNX Runtime's threads do not survive a fork:
forked after a test had run a session, mutants hung until their timeout). The report
(``tools/mutation-report.md``) gives each module's kill rate and every surviving mutant with its
diff and, if it was reviewed as equivalent (``EQUIVALENT`` below), why.

    .venv/bin/python tools/mutate.py                 # about 75 min on 2 cores
    .venv/bin/python tools/mutate.py --retest        # the last run's survivors, tests updated
    .venv/bin/python tools/mutate.py --report        # the report of the last run only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "mutate"
REPORT = ROOT / "tools" / "mutation-report.md"
PACKAGE_DIRS = {"runtime": "runtime", "exporter": "exporter", "quant": "quant", "bench": "bench",
                "fleet": "fleet"}
MODULES = ["estimator", "update", "losses", "rates", "stepcontrol", "shift", "guard", "state",
           "statelimits"]
TESTS = ["tests/test_objectives.py", "tests/test_estimator.py", "tests/test_batch_rates.py",
         "tests/test_guard_units.py", "tests/test_update.py",
         "tests/test_shift.py", "tests/test_guard.py", "tests/test_state_validation.py"]
TEST_MARKERS = "not integration and not slow"
# Lines not mutated: log calls and the text of error messages (wording, not numbers; the
# conditions that raise are mutated).
UNMUTATED_LINES = [r"^\s*log\.\w+\(", r"^\s*raise \w+\(f?[\"']", r"^\s*f?[\"'].*[\"'],?\)?$"]

# Surviving mutants reviewed as equivalent (no input the code can receive tells them apart).
EQUIVALENT: dict[str, str] = {
    "eva0_edge.runtime.statelimits.xǁStateLimitsǁcheck__mutmut_2":
        "astype(None) is astype(float64)",
    "eva0_edge.runtime.statelimits.xǁStateLimitsǁcheck__mutmut_22":
        "astype(None) is astype(float64)",
    "eva0_edge.runtime.statelimits.xǁStateLimitsǁ_check_shift__mutmut_31":
        "<= for < at the rounding allowance itself: differs only when the square equals "
        "norm2 (1 - 1e-9) - 1e-12 to the last bit",
    "eva0_edge.runtime.state.x__checked_array__mutmut_3":
        "np.array(copy=None) may alias the input, but the astype at the end copies anyway",
    "eva0_edge.runtime.state.x__checked_array__mutmut_5":
        "np.array without copy=True may alias the input, but the astype at the end copies anyway",
    "eva0_edge.runtime.state.x__checked_array__mutmut_6":
        "np.array(copy=False) may alias the input, but the astype at the end copies anyway",
    "eva0_edge.runtime.state.x__checked_array__mutmut_29":
        "astype(None) is astype(float64)",
    "eva0_edge.runtime.state.x_decode_state__mutmut_7":
        "allow_pickle=None is falsy: pickles stay refused",
    "eva0_edge.runtime.estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_5":
        "always redrawing a shared z gives the stored z: the plan is deterministic",
    "eva0_edge.runtime.estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_15":
        "reshape(pairs, -2): numpy reads any negative size as the unknown one",
    "eva0_edge.runtime.estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_17":
        "astype(None) is astype(float64)",
    "eva0_edge.runtime.estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_20":
        "astype(None) is astype(float64)",
    "eva0_edge.runtime.estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_23":
        "np.zeros(dtype=None) is float64",
    "eva0_edge.runtime.rates.x_step_rates__mutmut_5":
        "0.0 ** f is 0.0 for the positive f of any batch: momentum 0 stays 0",
    "eva0_edge.runtime.stepcontrol.x_limit_step__mutmut_10":
        "initial=1.0 for 0.0 in the peak: the peak only rescales before the norm, "
        "norm = peak ||delta / peak|| is the same",
}


def stage() -> None:
    """A fresh src-layout copy of the package, the tests and the shipped models."""
    if STAGE.exists():
        shutil.rmtree(STAGE)
    package = STAGE / "src" / "eva0_edge"
    shutil.copytree(ROOT / "src" / "eva0_edge", package)
    for name, folder in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / folder, package / name,
                        ignore=shutil.ignore_patterns("results", "__pycache__"))
    shutil.copytree(ROOT / "tests", STAGE / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "models", STAGE / "models")
    only = ", ".join(f'"src/eva0_edge/runtime/{m}.py"' for m in MODULES)
    selection = ", ".join(f'"{t}"' for t in [*TESTS, "-m", TEST_MARKERS])
    config = (ROOT / "pyproject.toml").read_text() + (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = [{only}]\n"
        f"pytest_add_cli_args_test_selection = [{selection}]\n"
        'also_copy = ["models"]\n'
        'process_isolation = "forkserver"\n'
        f"do_not_mutate_patterns = {json.dumps(UNMUTATED_LINES)}\n"
    )
    (STAGE / "pyproject.toml").write_text(config)


def mutmut(*args: str, capture: bool = False) -> str:
    out = subprocess.run([str(Path(sys.executable).with_name("mutmut")), *args], cwd=STAGE,
                         check=True, text=True, capture_output=capture,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out.stdout if capture else ""


DIFFS_SCRIPT = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
out = {}
for name in json.load(sys.stdin):
    module = name.split(".")[2]
    diff = get_diff_for_mutant(name, path=f"src/eva0_edge/runtime/{module}.py")
    out[name] = "\\n".join(line for line in diff.splitlines()
                           if line[:1] in "+-" and not line.startswith(("+++", "---")))
print(json.dumps(out))
"""


def diffs_of(names: list[str]) -> dict[str, str]:
    """Each mutant's changed lines, from mutmut in one process (``mutmut show`` per mutant
    costs a start-up each)."""
    out = subprocess.run([sys.executable, "-c", DIFFS_SCRIPT], cwd=STAGE, check=True, text=True,
                         capture_output=True, input=json.dumps(names))
    return json.loads(out.stdout)


def retest() -> None:
    """Run the last run's surviving and untested mutants again against the current tests
    (the mutated modules must not have changed since that run)."""
    for module in MODULES:
        staged = STAGE / "src" / "eva0_edge" / "runtime" / f"{module}.py"
        if staged.read_bytes() != (ROOT / "runtime" / f"{module}.py").read_bytes():
            raise SystemExit(f"runtime/{module}.py changed since the run: run it again whole")
    for target in (STAGE / "tests", STAGE / "mutants" / "tests"):
        shutil.rmtree(target)
        shutil.copytree(ROOT / "tests", target, ignore=shutil.ignore_patterns("__pycache__"))
    listed = mutmut("results", "--all", "true", capture=True)
    names = re.findall(r"^\s*(\S+): (?:survived|no tests)$", listed, flags=re.M)
    mutmut("run", "--max-children", str(os.cpu_count() or 2), *names)


def report() -> str:
    """The markdown report of the last run (from ``mutmut results --all true``)."""
    results = re.findall(r"^\s*(eva0_edge\.runtime\.(\w+)\.\S+): (.+)$",
                         mutmut("results", "--all", "true", capture=True), flags=re.M)
    status = Counter((module, state) for _, module, state in results)
    lines = ["# Mutation testing of the core numeric modules", "",
             "Made by `make mutate` (`tools/mutate.py`: mutmut over `runtime/` modules, tests "
             f"{', '.join(f'`{t}`' for t in TESTS)} with `-m \"{TEST_MARKERS}\"`).", "",
             "| module | mutants | killed | timeout | survived | equivalent (reviewed) | "
             "no test | kill rate | kill rate, equivalents aside |",
             "|---|---|---|---|---|---|---|---|---|"]
    totals = Counter()
    for module in MODULES:
        names = [n for n, m, _ in results if m == module]
        equivalent = sum(1 for n in names if n in EQUIVALENT)
        row = Counter(total=len(names), killed=status[module, "killed"],
                      timeout=status[module, "timeout"], survived=status[module, "survived"],
                      equivalent=equivalent, untested=status[module, "no tests"])
        totals.update(row)
        lines.append(_row(module, row))
    lines.append(_row("**all**", totals))
    lines += ["", "Timeouts are counted as killed (the mutant made the tests hang or crawl).",
              "", "## Surviving mutants", ""]
    listed = [name for name, _, state in results if state in ("survived", "no tests")]
    diffs = diffs_of(listed)
    for name, _, state in results:
        if state in ("survived", "no tests"):
            why = EQUIVALENT.get(name, "not reviewed")
            lines += [f"### `{name}` ({state}): {why}", "", "```diff", diffs[name], "```", ""]
    return "\n".join(lines) + "\n"


def _row(module: str, c: Counter) -> str:
    caught = c["killed"] + c["timeout"]
    rate = 100.0 * caught / c["total"] if c["total"] else float("nan")
    judged = c["total"] - c["equivalent"]
    net = 100.0 * caught / judged if judged else float("nan")
    return (f"| {module} | {c['total']} | {c['killed']} | {c['timeout']} | {c['survived']} | "
            f"{c['equivalent']} | {c['untested']} | {rate:.1f}% | {net:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="rewrite the report only")
    parser.add_argument("--retest", action="store_true",
                        help="rerun the last run's survivors against the current tests")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    if args.retest:
        retest()
    elif not args.report:
        stage()
        mutmut("run", "--max-children", str(args.max_children))
    REPORT.write_text(report())
    print(REPORT.read_text().split("## Surviving")[0])


if __name__ == "__main__":
    main()
