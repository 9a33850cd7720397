"""Mutation testing of the core numeric modules with mutmut (``make mutate``; not in CI).

mutmut imports the mutated code from ``mutants/src``, so the package is staged in the usual
``src/eva0_edge`` layout (the repository maps ``eva0_edge.runtime`` to ``runtime/`` and so on)
under ``build/mutate``; the unit tests run against it, each mutant in a process forked from a
server that has collected the tests but run none (ONNX Runtime's threads do not survive a fork:
forked after a test had run a session, mutants hung until their timeout). The report
(``tools/mutation-report.md``) gives each module's kill rate and every surviving mutant with its
diff and, if it was reviewed as equivalent (``EQUIVALENT`` below), why.

    .venv/bin/python tools/mutate.py                 # the report gives the run's time
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
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "mutate"
REPORT = ROOT / "tools" / "mutation-report.md"
RUN_RECORD = STAGE / "run.json"  # the last full run's wall time and load average
PACKAGE_DIRS = {"runtime": "runtime", "exporter": "exporter", "quant": "quant", "bench": "bench",
                "fleet": "fleet"}
MODULES = ["estimator", "update", "losses", "rates", "stepcontrol", "shift", "guard", "state",
           "statelimits"]
TESTS = ["tests/unit/test_objectives.py", "tests/unit/test_estimator.py",
         "tests/component/test_batch_rates.py", "tests/unit/test_guard_units.py",
         "tests/unit/test_update.py", "tests/component/test_shift.py",
         "tests/integration/test_guard.py", "tests/component/test_state_validation.py"]
TEST_MARKERS = "not integration and not slow"
# Lines not mutated: log calls and the text of error messages (wording, not numbers; the
# conditions that raise are mutated).
UNMUTATED_LINES = [r"^\s*log\.\w+\(", r"^\s*raise \w+\(f?[\"']", r"^\s*f?[\"'].*[\"'],?\)?$"]

# Surviving mutants reviewed as equivalent (no input the code can receive tells them apart),
# by reason; names without the leading ``eva0_edge.runtime.``.
EQUIVALENT_BY_REASON: list[tuple[str, list[str]]] = [
    (
        "astype(None) is astype(float64)",
        [
            "statelimits.xǁStateLimitsǁcheck__mutmut_2",
            "statelimits.xǁStateLimitsǁcheck__mutmut_22",
            "state.x__checked_array__mutmut_29",
            "estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_17",
            "estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_20",
            "estimator.xǁObjectiveǁ__call____mutmut_19",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_105",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_121",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_136",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_148",
            "estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_29",
            "guard.xǁSignalWindowsǁadd__mutmut_2",
            "guard.xǁFeatureWindowǁadd__mutmut_2",
            "shift.x_source_head_mean__mutmut_6",
            "shift.x_source_head_mean__mutmut_12",
            "shift.x_load_shift__mutmut_37",
            "update.x_apply_update__mutmut_12",
            "update.x_apply_update__mutmut_14",
            "update.x_apply_update__mutmut_87",
            "update.x_update_statistics__mutmut_15",
        ]),
    (
        "<= for < at the rounding allowance itself: differs only when the square equals norm2 (1 -"
        " 1e-9) - 1e-12 to the last bit",
        ["statelimits.xǁStateLimitsǁ_check_shift__mutmut_31"]),
    (
        "np.array(copy=None) may alias the input, but the astype at the end copies anyway",
        ["state.x__checked_array__mutmut_3"]),
    (
        "np.array without copy=True may alias the input, but the astype at the end copies anyway",
        ["state.x__checked_array__mutmut_5"]),
    (
        "np.array(copy=False) may alias the input, but the astype at the end copies anyway",
        ["state.x__checked_array__mutmut_6"]),
    (
        "allow_pickle=None is falsy: pickles stay refused",
        ["state.x_decode_state__mutmut_7"]),
    (
        "always redrawing a shared z gives the stored z: the plan is deterministic",
        ["estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_5"]),
    (
        "reshape(pairs, -2): numpy reads any negative size as the unknown one",
        ["estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_15"]),
    (
        "np.zeros(dtype=None) is float64",
        [
            "estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_23",
            "estimator.xǁZerothOrderEstimatorǁ_gradient__mutmut_25",
            "state.xǁAdaptStateǁinitial__mutmut_23",
            "state.xǁAdaptStateǁinitial__mutmut_25",
            "state.xǁAdaptStateǁinitial__mutmut_27",
            "state.xǁAdaptStateǁinitial__mutmut_29",
            "state.xǁAdaptStateǁinitial__mutmut_31",
            "state.xǁAdaptStateǁinitial__mutmut_33",
        ]),
    (
        "0.0 ** f is 0.0 for the positive f of any batch: momentum 0 stays 0",
        ["rates.x_step_rates__mutmut_5"]),
    (
        "initial=1.0 for 0.0 in the peak: the peak only rescales before the norm, norm = peak "
        "||delta / peak|| is the same",
        ["stepcontrol.x_limit_step__mutmut_10"]),
    (
        "d_bar is read by anchor rows only; with n_anchor = 0 the plan has none",
        ["estimator.xǁZerothOrderEstimatorǁestimate__mutmut_6"]),
    (
        "rows drawn ahead are the step's own draw bit for bit (test_estimator checks it); dropping"
        " them redraws the same rows: time only",
        [
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_33",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_39",
        ]),
    (
        "slice(None, half) and slice(half) are slice(0, half)",
        [
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_73",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_75",
        ]),
    (
        "the rows are exactly 2 half long: slice(half, None) and slice(half, 3 half) end at 2 half",
        [
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_79",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_83",
        ]),
    (
        "reshape(..., -2): numpy reads any negative size as the unknown one",
        [
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_96",
            "estimator.xǁZerothOrderEstimatorǁestimate__mutmut_109",
        ]),
    (
        "Z regenerated chunk by chunk instead of kept: the same rows bit for bit (the regenerate "
        "test checks the gradient): memory and time only",
        ["estimator.xǁZerothOrderEstimatorǁestimate__mutmut_179"]),
    (
        "the chunk size of the row filling: the same rows, memory only",
        [
            "estimator.xǁZerothOrderEstimatorǁ_perturbed_rows__mutmut_12",
            "estimator.xǁZerothOrderEstimatorǁ_perturbed_rows__mutmut_13",
        ]),
    (
        "Z kept or dropped (then regenerated for the gradient): the same numbers, memory only",
        [
            "estimator.xǁZerothOrderEstimatorǁ_perturbed_rows__mutmut_45",
            "estimator.xǁZerothOrderEstimatorǁ_perturbed_rows__mutmut_47",
        ]),
    (
        "weight 0 is below checked_weight (> 0 for any window >= 1): zero offset either way",
        ["shift.xǁActivationShiftǁoffset__mutmut_5"]),
    (
        "the square of a window reset to weight 0: windowed_update weighs the old value by 0",
        [
            "shift.xǁActivationShiftǁobserve__mutmut_19",
            "shift.xǁActivationShiftǁobserve__mutmut_27",
        ]),
    (
        "<= for < at a window's threshold weight: equal only for a batch of exactly 32 samples "
        "into empty windows, whose own samples fill both windows (z^2 of a step inside one such "
        "batch is about 5, under 9): the change test runs one batch later, with the same verdict",
        [
            "shift.xǁActivationShiftǁ_changed__mutmut_6",
            "shift.xǁActivationShiftǁ_changed__mutmut_7",
        ]),
    (
        "the variance floor (1e-12 (1 + ||m||^2)) only keeps 0 > 0 false on a window without "
        "variance; any floor of that size gives the same verdicts",
        [
            "shift.xǁActivationShiftǁ_changed__mutmut_25",
            "shift.xǁActivationShiftǁ_changed__mutmut_28",
        ]),
    (
        ">= for > at z exactly 3: equality of a float statistic with the threshold",
        ["shift.xǁActivationShiftǁ_changed__mutmut_31"]),
    (
        "the seed of the random probe image: any image checks the head",
        ["shift.x_load_shift__mutmut_16", "shift.x_load_shift__mutmut_17"]),
    (
        "momentum 0: the damped velocity 0 v + 1 g is g (a state's velocity is finite, checked on "
        "load)",
        ["update.x_apply_update__mutmut_17"]),
    (
        "c = 0: the correction (scale - 1) c e is 0 either way",
        ["update.x_balance__mutmut_30"]),
    (
        "factor ** an integer arange is float64 either way",
        ["rates.x_windowed_update__mutmut_8", "rates.x_windowed_update__mutmut_12"]),
    (
        "np.load's allow_pickle defaults to False",
        ["state.x_decode_state__mutmut_9"]),
    (
        "a state without a version: 0 or 1, it is only compared with the current version",
        ["state.x_decode_state__mutmut_28"]),
    (
        "an info that is not a dict is returned as {} just below",
        ["state.x_decode_state__mutmut_52", "state.x_decode_state__mutmut_54"]),
]
EQUIVALENT = {f"eva0_edge.runtime.{name}": reason for reason, names in EQUIVALENT_BY_REASON
              for name in names}


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
    shutil.copy(ROOT / "tools" / "mutate_conftest.py", STAGE / "conftest.py")
    only = ", ".join(f'"src/eva0_edge/runtime/{m}.py"' for m in MODULES)
    selection = ", ".join(f'"{t}"' for t in [*TESTS, "-m", TEST_MARKERS])
    config = (ROOT / "pyproject.toml").read_text() + (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = [{only}]\n"
        f"pytest_add_cli_args_test_selection = [{selection}]\n"
        'also_copy = ["models", "conftest.py"]\n'
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
             *_run_line(),
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
    stale = sorted(set(EQUIVALENT) - set(listed))
    if stale:  # reviewed as equivalent, yet killed (or gone): the review list is out of date
        lines += ["Reviewed as equivalent but not surviving this run (remove from "
                  "`EQUIVALENT_BY_REASON`):", "", *(f"- `{name}`" for name in stale), ""]
    diffs = diffs_of(listed)
    for name, _, state in results:
        if state in ("survived", "no tests"):
            why = EQUIVALENT.get(name, "not reviewed")
            lines += [f"### `{name}` ({state}): {why}", "", "```diff", diffs[name], "```", ""]
    return "\n".join(lines) + "\n"


def _run_line() -> list[str]:
    """The last full run's wall time and load, as measured by :func:`main`."""
    if not RUN_RECORD.exists():
        return []
    run = json.loads(RUN_RECORD.read_text())
    return [f"The last full run took {run['minutes']:.1f} min on {run['cpus']} CPUs "
            f"({run['children']} mutants at a time; load average {run['load_before']:.2f} "
            f"before, {run['load_after']:.2f} after).", ""]


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
        load, started = os.getloadavg()[0], time.monotonic()
        mutmut("run", "--max-children", str(args.max_children))
        RUN_RECORD.write_text(json.dumps({
            "minutes": (time.monotonic() - started) / 60, "cpus": os.cpu_count(),
            "children": args.max_children, "load_before": load,
            "load_after": os.getloadavg()[0]}))
    REPORT.write_text(report())
    print(REPORT.read_text().split("## Surviving")[0])


if __name__ == "__main__":
    main()
