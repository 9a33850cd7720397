"""Does the domain bank make a returning domain cheap? The soak with short domains.

Issue 49's soak target: each test corruption as a 300-image domain, the fifteen in one stream
ten times over (never reset), at batch sizes 1, 16 and 64, for

* ``noadapt-shift``: the one-forward tier;
* ``eva0``: full-rate EVA-0 (two forwards for every sample);
* ``eva0+bank``: the same with a domain bank of ``--slots`` slots;
* ``eva0@F`` and ``eva0@F+bank`` for each budget F of ``--budgets``.

Per run it keeps the accuracy of each pass, the counted forwards per sample of passes 2-10
(the forward counter read at each pass's start and end), the bank's hits, misses and
evictions, and for every returning visit of a domain the accuracy of its first ``--edge``
images against that of the last ``--edge`` of its previous visit (the sample-level
predictions, not batch means), and against the first ``--edge`` of its previous visit (the
same images: a domain streams in the same order on every pass). Fifty images make one
visit's gap noisy (about 8 points of standard deviation between two halves of a domain), so
the table reads the mean over the 135 returns, and that mean less NoAdapt's (NoAdapt keeps no
state: its gap is the images' difficulty alone, the first 50 and the last 50 being other
images); ``return_profile`` is the accuracy along a
returning visit (bins of ``PROFILE_BIN`` images, mean over the returns), where the changes'
cost shows: the images before the detector calls a change are served by the previous
domain's state. The test split is only measured: nothing here is tuned.

    python studies/domain-bank/soak.py --out results/domain-bank

Keeps ``soak.jsonl`` (one line per model, severity, batch size and run: a rerun replaces its
line), prints a line per run and writes ``soak.md`` (the table of every run in ``soak.jsonl``;
``--table-only`` writes just that).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.datasets import Domain, fmnist_c_domains
from eva0_edge.bench.testbed.protocols import schedule
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import SessionSettings

PROFILE_BIN = 10  # images per bin of the accuracy profile along a returning visit


def runs(budgets: list[float], slots: int) -> dict[str, tuple[str, dict]]:
    """Run label -> (method, config overrides)."""
    table: dict[str, tuple[str, dict]] = {"noadapt": ("noadapt", {}),
                                          "noadapt-shift": ("noadapt-shift", {}),
                                          "eva0": ("eva0", {}),
                                          "eva0+bank": ("eva0", {"bank_slots": slots})}
    for budget in budgets:
        table[f"eva0@{budget:g}"] = ("eva0", {"budget": budget})
        table[f"eva0@{budget:g}+bank"] = ("eva0", {"budget": budget, "bank_slots": slots})
    return table


def soak(model: str, method: str, config: dict, domains: list[Domain], batch: int,
         passes: int, edge: int, seed: int) -> dict:
    """One soak run: accuracy per pass, forwards per sample of passes 2+, the bank's counters
    and the first-vs-last-``edge`` accuracy of every returning visit."""
    policy = load_method(model, method, config, seed, SessionSettings(threads=1))
    pre = read_metadata(model).preprocessing
    segments = schedule(domains, "soak", seed, passes)
    per_pass_hits = np.zeros(passes)
    per_pass_seen = np.zeros(passes)
    forwards_at = []
    last_visit: dict[str, np.ndarray] = {}
    returns = []
    visits = []
    profile_hits = np.zeros(segments[0].order.size)
    profile_seen = np.zeros(segments[0].order.size)
    for index, segment in enumerate(segments):
        pass_index = index // len(domains)
        if index % len(domains) == 0:
            forwards_at.append(policy.stats()["forwards"])
        stream = segment.domain.subset(segment.order)
        hits = np.concatenate([policy.step(x).argmax(axis=1) == y
                               for x, y in stream.batches(batch, pre)])
        per_pass_hits[pass_index] += hits.sum()
        per_pass_seen[pass_index] += hits.size
        name = segment.domain.name
        if name in last_visit:
            returns.append({"first": 100.0 * hits[:edge].mean(),
                            "previous_first": 100.0 * last_visit[name][:edge].mean(),
                            "previous_last": 100.0 * last_visit[name][-edge:].mean()})
            profile_hits[:hits.size] += hits
            profile_seen[:hits.size] += 1
        last_visit[name] = hits
        visits.append([round(100.0 * hits[:edge].mean(), 1), round(100.0 * hits[-edge:].mean(), 1)])
    stats = policy.stats()
    forwards_at.append(stats["forwards"])
    later = per_pass_seen[1:].sum()
    gaps = [r["first"] - r["previous_last"] for r in returns]
    same_images = [r["first"] - r["previous_first"] for r in returns]
    return {
        "passes": [round(100.0 * h / s, 3)
                   for h, s in zip(per_pass_hits, per_pass_seen, strict=True)],
        "passes_2_on": round(100.0 * per_pass_hits[1:].sum() / later, 3),
        "forwards_2_on": round((forwards_at[-1] - forwards_at[1]) / later, 4),
        "forwards": round(stats["forwards_per_sample"], 4),
        "bank": stats.get("bank"),
        "guard_trips": (stats.get("guard") or {}).get("trips"),
        "returns_worst_gap": round(min(gaps), 3) if gaps else None,
        "returns_mean_gap": round(float(np.mean(gaps)), 3) if gaps else None,
        "returns_below_minus_1": int(sum(g < -1.0 for g in gaps)),
        "returns_count": len(gaps),
        "returns_mean_gap_same_images": (round(float(np.mean(same_images)), 3)
                                         if same_images else None),
        "visits_first_last": visits,
        "return_profile": [round(100.0 * profile_hits[i:i + PROFILE_BIN].sum()
                                 / max(profile_seen[i:i + PROFILE_BIN].sum(), 1), 2)
                           for i in range(0, profile_hits.size, PROFILE_BIN)],
    }


def keep_row(row: dict, path: Path) -> None:
    """Put ``row`` into the runs at ``path`` (JSON lines), in place of a run with the same model,
    severity, batch size and label; written whole to a sibling file and renamed over it."""
    key = ("model", "severity", "batch", "run")
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    index = next((i for i, r in enumerate(rows) if all(r[k] == row[k] for k in key)), None)
    if index is None:
        rows.append(row)
    else:
        rows[index] = row
    partial = path.with_suffix(".partial")
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    partial.replace(path)


def write_table(rows: list[dict], path: Path) -> None:
    """The runs of ``rows`` (soak.jsonl's) as a markdown table at ``path``."""
    noadapt = {(r["model"], r["severity"], r["batch"]): r["returns_mean_gap"]
               for r in rows if r["run"] == "noadapt"}
    lines = ["| model | sev | B | run | passes 2+ (%) | fwd/sample passes 2+ | "
             "first 50 - previous last 50 (mean) | the same, less NoAdapt's | "
             "first 50 - previous first 50 (mean) | hits / misses / evictions | guard trips |",
             "|" + "---|" * 11]
    for r in rows:
        bank = r["bank"]
        counts = f"{bank['hits']} / {bank['misses']} / {bank['evictions']}" if bank else "-"
        base = noadapt.get((r["model"], r["severity"], r["batch"]))
        relative = "-" if base is None else f"{r['returns_mean_gap'] - base:+.2f}"
        lines.append(
            f"| {r['model']} | {r['severity']} | {r['batch']} | {r['run']} | "
            f"{r['passes_2_on']:.2f} | {r['forwards_2_on']:.3f} | {r['returns_mean_gap']:+.2f} | "
            f"{relative} | {r['returns_mean_gap_same_images']:+.2f} | {counts} | "
            f"{r['guard_trips']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet_gn_fmnist,vit_fmnist,mobilenet_bn_fmnist")
    parser.add_argument("--severities", default="5")
    parser.add_argument("--batch-sizes", default="16")
    parser.add_argument("--budgets", default="1.25")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--runs", default="", help="comma-separated run labels (default all)")
    parser.add_argument("--limit", type=int, default=300, help="images per domain")
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--edge", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table-only", action="store_true",
                        help="only write soak.md from the runs in soak.jsonl")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    indices = np.sort(np.random.default_rng(args.seed).choice(10000, args.limit, replace=False))
    table = runs([float(b) for b in args.budgets.split(",")], args.slots)
    chosen = args.runs.split(",") if args.runs else list(table)
    out = args.out / "soak.jsonl"
    if args.table_only:
        write_table([json.loads(line) for line in out.read_text().splitlines()],
                    args.out / "soak.md")
        return
    for severity in map(int, args.severities.split(",")):
        domains = fmnist_c_domains(severity, "test", indices=indices, progress=False)
        for name in args.models.split(","):
            for batch in map(int, args.batch_sizes.split(",")):
                for label in chosen:
                    method, config = table[label]
                    row = {"model": name, "severity": severity, "batch": batch, "run": label,
                           "limit": args.limit, "passes_run": args.passes,
                           **soak(f"models/{name}.onnx", method, config, domains, batch,
                                  args.passes, args.edge, args.seed)}
                    keep_row(row, out)
                    print(f"{name:18s} S={severity} B={batch:<3d} {label:16s} "
                          f"passes 2+ {row['passes_2_on']:6.2f} at {row['forwards_2_on']:.3f} "
                          f"fw/s, worst return gap {row['returns_worst_gap']}, "
                          f"bank {row['bank']}", flush=True)
    write_table([json.loads(line) for line in out.read_text().splitlines()],
                args.out / "soak.md")


if __name__ == "__main__":
    main()
