"""Issue 49's budget targets, read off a ``make pareto`` summary.

For every model, protocol, severity and batch size of ``budget.json``: the one-forward tier
(``noadapt-shift``), full-rate EVA-0 and EVA-0 at budgets 1.5 and 1.25 (without a bank, and
with each bank size the summary holds), and the two targets:

* ``1.5 ok``: EVA-0 at budget 1.5 >= full-rate EVA-0 - 0.3;
* ``1.25 ok``: EVA-0 at budget 1.25 keeps >= half of full-rate EVA-0's gain over the tier
  (met trivially where full rate gains nothing over the tier and 1.25 is not below it).

    python studies/budget-targets/targets.py out/pareto/budget.json > results/pareto/targets.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

TOLERANCE_15 = 0.3  # points budget 1.5 may lose to full rate


def cells(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(model, protocol, severity, batch, bank) -> method label -> row; the tier and the
    full-rate reference (bank 0) are shared by every bank setting of their cell."""
    by_cell: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        key = (row["model"], row["protocol"], str(row["severity"]), row["batch_size"])
        by_cell[(*key, row.get("bank", 0))][row["method"]] = row
    for (model, protocol, severity, batch, bank), methods in by_cell.items():
        if bank:
            base = by_cell.get((model, protocol, severity, batch, 0), {})
            methods.setdefault("noadapt-shift", base.get("noadapt-shift"))
            methods["eva0 (no bank)"] = base.get("eva0")
    return by_cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="budget.json of make pareto")
    args = parser.parse_args()
    rows = json.loads(args.summary.read_text())["rows"]
    print("| model | protocol | sev | B | bank | tier | full | 1.5 (fwd) | 1.25 (fwd) | "
          "1.5 - full | 1.5 ok | 1.25 kept of the gain | 1.25 ok |")
    print("|" + "---|" * 13)
    met = {"1.5": [0, 0], "1.25": [0, 0]}
    for key, methods in sorted(cells(rows).items()):
        tier, full = methods.get("noadapt-shift"), methods.get("eva0")
        b15, b125 = methods.get("eva0 budget 1.5"), methods.get("eva0 budget 1.25")
        if not (tier and full and b15 and b125):
            continue
        loss = b15["average"] - full["average"]
        ok15 = loss >= -TOLERANCE_15
        gain = full["average"] - tier["average"]
        kept = b125["average"] - tier["average"]
        ok125 = kept >= 0.5 * gain if gain > 0 else kept >= 0
        share = f"{kept / gain:.2f}" if gain > 0 else f"gain {gain:+.2f}"
        for name, ok in (("1.5", ok15), ("1.25", ok125)):
            met[name][0] += ok
            met[name][1] += 1
        model, protocol, severity, batch, bank = key
        print(f"| {model} | {protocol} | {severity} | {batch} | {bank} | {tier['average']:.2f} | "
              f"{full['average']:.2f} | {b15['average']:.2f} ({b15['forwards_per_sample']:.2f}) "
              f"| {b125['average']:.2f} ({b125['forwards_per_sample']:.2f}) | {loss:+.2f} | "
              f"{'yes' if ok15 else 'NO'} | {share} | {'yes' if ok125 else 'NO'} |")
    print()
    for name, (ok, total) in met.items():
        print(f"budget {name}: target met in {ok} of {total} cells")


if __name__ == "__main__":
    main()
