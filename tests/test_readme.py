"""The README's numbers come from runs: the demo's line and the budget, layer and GPU tables
are the committed runs' results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_line_is_the_committed_demo_run():
    """``make demo``'s averages, as its run wrote them to bench/results/demo/results.json."""
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"\((\d+\.\d)% -> (\d+\.\d)% in `bench/results/demo/`", readme)
    assert quoted, "the README's demo line is missing"
    results = json.loads((ROOT / "bench" / "results" / "demo" / "results.json").read_text())
    averages = {name.split()[0]: run["average"] for name, run in results["results"].items()}
    assert (float(quoted[1]), float(quoted[2])) == (
        round(averages["noadapt"], 1), round(averages["eva0"], 1))


def test_the_budget_and_layer_tables_are_the_committed_runs():
    """``make budget``'s, ``make layers``' and ``make hostile``'s tables, as their summaries
    wrote them to bench/results/{budget,layers,layers/vit-300,foa-budget,soak-budget,hostile}/,
    appear in the README verbatim."""
    readme = (ROOT / "README.md").read_text()
    for run, name in (("budget", "budget"), ("layers", "layers"), ("layers/vit-300", "layers"),
                      ("foa-budget", "budget"), ("soak-budget", "budget"), ("hostile", "hostile")):
        table = (ROOT / "bench" / "results" / run / f"{name}.md").read_text().strip()
        assert table in readme, f"the README's {run} table is not bench/results/{run}/{name}.md"


def test_the_gpu_tables_are_the_committed_gpu_run():
    """``bench/gpu_check.sh``'s tables, as bench/gpu_summary.py wrote them for the H100 run in
    bench/results/h100-2026-11-28/final/ and for the budget run in
    bench/results/h100-budget/3-subgrid/, appear in the README verbatim."""
    readme = (ROOT / "README.md").read_text()
    run = ROOT / "bench" / "results" / "h100-2026-11-28" / "final"
    assert (run / "gpu.md").read_text().strip() in readme
    assert "bench/results/h100-2026-11-28/final/" in readme
    budget = ROOT / "bench" / "results" / "h100-budget" / "3-subgrid"
    assert (budget / "gpu.md").read_text().strip() in readme
    assert "bench/results/h100-budget/3-subgrid/" in readme


def test_the_asynchronous_serving_tables_are_the_committed_runs():
    """The async_stream and serve_load tables of ``serve --async-adapt`` in the README are the
    committed runs' (bench/results/async-stream/, bench/results/serve-async/), row for row."""
    readme = (ROOT / "README.md").read_text()
    for run, stem in (("async-stream", "async_stream"), ("serve-async", "serve_load")):
        text = (ROOT / "bench" / "results" / run / f"{stem}.md").read_text()
        table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
        assert table in readme, f"the README's {run} table is not bench/results/{run}/{stem}.md"


@pytest.mark.parametrize("run, stem", [("quant-speed", "quant_speed"),
                                       ("quant-accuracy", "quant_accuracy")])
def test_the_quantized_tables_are_the_committed_runs(run, stem):
    """``make quant``'s tables, as bench/results/quant-{speed,accuracy}/ have them."""
    readme = (ROOT / "README.md").read_text()
    text = (ROOT / "bench" / "results" / run / f"{stem}.md").read_text()
    tables = re.findall(r"(?:^\|.*\n?)+", text, flags=re.M)
    assert tables and f"bench/results/{run}/" in readme
    for table in tables:
        assert table.strip() in readme
