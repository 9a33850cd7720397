"""The README's and the docs' numbers come from runs: the demo's line and table, and the
budget, layer, hostile, quantization, GPU and serving tables of docs/results/, are the
committed runs' results, verbatim."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def page(name: str) -> str:
    """The text of docs/results/<name>.md."""
    return (RESULTS / f"{name}.md").read_text()


def tables(text: str) -> list[str]:
    """Every Markdown table of ``text`` (runs of lines that start with '|')."""
    return [t.strip() for t in re.findall(r"(?:^\|.*\n?)+", text, flags=re.M)]


def test_the_demo_line_is_the_committed_demo_run():
    """``make demo``'s averages, as its run wrote them to results/demo/results.json."""
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"\((\d+\.\d)% -> (\d+\.\d)% in `results/demo/`", readme)
    assert quoted, "the README's demo line is missing"
    results = json.loads((ROOT / "results" / "demo" / "results.json").read_text())
    averages = {name.split()[0]: run["average"] for name, run in results["results"].items()}
    assert (float(quoted[1]), float(quoted[2])) == (
        round(averages["noadapt"], 1), round(averages["eva0"], 1))


@pytest.mark.parametrize("where", ["README.md", "docs/results/demo.md"])
def test_the_headline_table_is_the_committed_demo_run(where):
    """The README's one results table, and the demo page's, are results/demo/results.md's
    table, and both name that run."""
    text = (ROOT / where).read_text()
    (table,) = tables((ROOT / "results" / "demo" / "results.md").read_text())
    assert table in text, f"{where}'s demo table is not results/demo/results.md"
    assert "results/demo/" in text


def test_the_budget_and_layer_tables_are_the_committed_runs():
    """``make budget``'s, ``make layers``' and ``make hostile``'s tables, as their summaries
    wrote them to results/{budget,layers,layers/vit-300,foa-budget,soak-budget,hostile,
    pareto/seeds}/ (and the domain-bank soak's, results/domain-bank/soak.md),
    appear verbatim on the results pages, which name the run."""
    for run, name, where in (("budget", "budget", "budget"), ("layers", "layers", "layers"),
                             ("layers/vit-300", "layers", "layers"),
                             ("foa-budget", "budget", "budget"),
                             ("soak-budget", "budget", "budget"),
                             ("hostile", "hostile", "hostile"),
                             ("pareto/seeds", "seeds", "budget"),
                             ("domain-bank", "soak", "bank")):
        text = page(where)
        table = (ROOT / "results" / run / f"{name}.md").read_text().strip()
        assert table in text, f"docs/results/{where}.md's {run} table is not " \
                              f"results/{run}/{name}.md"
        assert f"results/{run}/" in text


def test_the_gpu_tables_are_the_committed_gpu_run():
    """``bench/gpu_check.sh``'s tables, as bench/gpu_summary.py wrote them for the H100 run in
    results/h100-2026-11-28/final/, the budget run in results/h100-budget/3-subgrid/ and the
    H200 runs of the device step in results/h200-2026-12-04/ (and that run's CUDA-graph
    table, studies/device-step/graphs_table.py's), appear verbatim on docs/results/gpu.md."""
    text = page("gpu")
    run = ROOT / "results" / "h100-2026-11-28" / "final"
    assert (run / "gpu.md").read_text().strip() in text
    assert "results/h100-2026-11-28/final/" in text
    budget = ROOT / "results" / "h100-budget" / "3-subgrid"
    assert (budget / "gpu.md").read_text().strip() in text
    assert "results/h100-budget/3-subgrid/" in text
    for run in ("first", "final", "head", "head-layers"):  # the device step on an H200
        folder = ROOT / "results" / "h200-2026-12-04" / run
        assert (folder / "gpu.md").read_text().strip() in text
        assert f"results/h200-2026-12-04/{run}/" in text
    graphs = ROOT / "results" / "h200-2026-12-04" / "final" / "graphs.md"
    assert graphs.read_text().strip() in text


def test_the_asynchronous_serving_tables_are_the_committed_runs():
    """The async_stream and serve_load tables of ``serve --async-adapt`` on
    docs/results/serving.md are the committed runs' (results/async-stream/,
    results/serve-async/, results/serve-perf-analyzer/ and results/serve-steady/: perf_analyzer's
    load), row for row."""
    text = page("serving")
    for run, stem in (("async-stream", "async_stream"), ("serve-async", "serve_load"),
                      ("serve-perf-analyzer", "serve_load"),
                      ("serve-steady/one-client", "serve_load"),
                      ("serve-steady/thirteen-clients", "serve_load"),
                      ("serve-steady/default-threads/one-client", "serve_load"),
                      ("serve-steady/default-threads/thirteen-clients", "serve_load")):
        summary = (ROOT / "results" / run / f"{stem}.md").read_text()
        table = "\n".join(line for line in summary.splitlines() if line.startswith("|"))
        assert table in text, f"docs/results/serving.md's {run} table is not " \
                              f"results/{run}/{stem}.md"
        assert f"results/{run}" in text


@pytest.mark.parametrize("run, stem", [("quant-speed", "quant_speed"),
                                       ("quant-accuracy", "quant_accuracy")])
def test_the_quantized_tables_are_the_committed_runs(run, stem):
    """``make quant``'s tables, as results/quant-{speed,accuracy}/ have them, on
    docs/results/quantization.md."""
    text = page("quantization")
    found = tables((ROOT / "results" / run / f"{stem}.md").read_text())
    assert found and f"results/{run}/" in text
    for table in found:
        assert table in text


def test_every_committed_run_the_docs_name_exists():
    """A results folder or file named in the README or the docs (`results/...`,
    `models/...`) is in the repository: a page never cites a run that is not committed."""
    texts = [(ROOT / "README.md").read_text()] + [
        p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    named = {m for text in texts
             for m in re.findall(r"`((?:results|models|studies)/[^`\s]*)`", text)
             if not set("*<{") & set(m)}
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"named in the docs but not committed: {missing}"
