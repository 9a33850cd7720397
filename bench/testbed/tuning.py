"""The tuning rule of ``models/recipes/tune.py`` (moved here from the recipe, unchanged): a grid
from ``--grid`` items, the forwards a compute budget may spend on a run's stream, the choice
among a grid's logged rows, and the next point past a one-axis grid's edge."""

from __future__ import annotations

import itertools
from typing import Any

from eva0_edge.runtime.budget import forwards_bound
from eva0_edge.runtime.config import parse_key_values

from .protocols import StreamResult


def parse_grid(items: list[str]) -> list[dict[str, Any]]:
    """``["eta=0.001,0.002", "lambda_swa=0,50"]`` -> the product of the listed values."""
    axes = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep:
            raise ValueError(f"bad --grid {item!r}: use KEY=V1,V2,...")
        key = key.strip()  # values as --set reads them: "256" an int, "0.002" a float
        axes.append([(key, parse_key_values([f"{key}={v.strip()}"])[key])
                     for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def spending_bound(budget: float, protocol: str, result: StreamResult) -> float:
    """The forwards per sample a budget of ``budget`` may spend on ``result``'s stream: its own
    bucket's start and one batch over the samples between resets (the whole continual stream,
    one domain of the single protocol); ``budget`` itself when the run had no budget."""
    spent = result.final_stats.get("budget")
    if spent is None:
        return budget
    runs = 1 if protocol == "continual" else len(result.accuracy)
    return forwards_bound(budget, spent["burst"], sum(result.batch_size) // runs, result.batch)


def choose(
    rows: list[dict], reference: dict[str, float], margin: float,
    max_forwards: float | None = None,
) -> dict:
    """The tuning rule (``models/recipes/tune.py``'s docstring states it); marks each row
    ``eligible``, ``mean_corrupted``, ``worst_corrupted`` and ``worst_gain``. With
    ``max_forwards`` a row is eligible only when every corrupted cell's measured forwards per
    sample stays within the row's
    ``forwards_bound`` for the cell (:func:`spending_bound`; ``max_forwards`` where a log has
    none)."""
    for row in rows:
        cells = row["cells"]
        gains = {k: cells[k] - reference[k] for k in cells}
        corrupted = [v for k, v in cells.items() if not k.startswith("clean")]
        row["mean_corrupted"] = sum(corrupted) / len(corrupted)
        row["worst_corrupted"] = min(corrupted)
        row["worst_gain"] = min(gains.values())
        bounds = row.get("forwards_bound", {})
        row["eligible"] = all(gains[k] >= -margin for k in gains if k.startswith("clean")) and (
            max_forwards is None or all(f <= bounds.get(k, max_forwards)
                                        for k, f in row["forwards"].items()))
    eligible = [r for r in rows if r["eligible"]]
    if eligible:
        return max(eligible, key=lambda r: (r["worst_corrupted"], r["mean_corrupted"]))
    return max(rows, key=lambda r: r["worst_gain"])


def beyond_edge(best: dict[str, float], tried: list[dict[str, float]]) -> dict | None:
    """For a one-axis grid whose best value is its smallest or largest: that value halved or
    doubled (the next point past the edge; an integer stays one); None otherwise."""
    if len(best) != 1:
        return None
    (key, value), = best.items()
    values = sorted(c[key] for c in tried)
    if value not in (values[0], values[-1]):
        return None
    if isinstance(value, int):
        return {key: max(1, value // 2) if value == values[0] else value * 2}
    return {key: float(f"{value / 2 if value == values[0] else value * 2:.6g}")}
