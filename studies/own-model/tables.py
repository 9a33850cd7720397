"""Tables of (a) (b) (c) from results/own-model/<model>-<stage>/{clean,hostile,continual,single}."""
import json
from pathlib import Path

import numpy as np

R = Path("results/own-model")
BS = (1, 4, 16, 64)


def load(d):
    f = d / "results.json"
    return json.loads(f.read_text())["results"] if f.is_file() else None


def cell(res, method, b):
    return res.get(f"{method} B={b}") or res.get(method)


def by_batch(res):
    """'NoAdapt / EVA-0 (difference)' per batch size, and the differences."""
    diffs, parts = [], []
    for b in BS:
        n, e = cell(res, "noadapt", b)["average"], cell(res, "eva0", b)["average"]
        diffs.append(e - n)
        parts.append(f"{n:.2f} / {e:.2f} ({e - n:+.2f})")
    return parts, diffs


def clean_row(d):
    res = load(d / "clean")
    if res is None:
        return None
    parts, diffs = by_batch(res)
    return parts, all(x >= -0.5 for x in diffs)


def hostile_row(d):
    t = d / "hostile" / "traces.npz"
    if not t.is_file():
        return None
    z = np.load(t, allow_pickle=True)
    methods = list(z["methods"])
    seg = {}
    for i, m in enumerate(methods):
        dom, cor = z[f"batch_domain_{i}"], z[f"batch_correct_{i}"]
        # segments in stream order: black, clean, noise, clean
        change = np.flatnonzero(dom[1:] != dom[:-1]) + 1
        bounds = np.split(np.arange(len(dom)), change)
        seg[m] = [100.0 * cor[s].sum() / len(s) for s in bounds if dom[s[0]] == "clean"]
    n, e = seg["noadapt"], seg["eva0"]
    parts = [f"{a:.2f} / {b:.2f} ({b - a:+.2f})" for a, b in zip(n, e, strict=True)]
    return parts, all(b - a >= -1.0 for a, b in zip(n, e, strict=True))


def corr_row(d, protocol):
    res = load(d / protocol)
    if res is None:
        return None
    parts, diffs = by_batch(res)
    return parts, all(x > 0 for x in diffs)


def pf(ok):
    return "**pass**" if ok else "**FAIL**"


tags = sorted({p.name.rsplit("-", 1)[0] for p in R.iterdir() if p.is_dir()})
print("## (a) guard / shift on, clean within 0.5 of NoAdapt, hostile-then-clean within 1\n")
print("NoAdapt / EVA-0 (EVA-0 - NoAdapt), test split. user files: after `calibrate`; shipped: "
      "as shipped.\n")
print("| model | stage | guard | shift | clean B=1 | B=4 | B=16 | B=64 | clean target | "
      "hostile: clean after black | clean after noise | hostile target |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for tag in tags:
    for stage in ("calibrate", "shipped", "tune"):
        d = R / f"{tag}-{stage}"
        if not (d / "clean").is_dir() and not (d / "policy-stats.json").is_file():
            continue
        ps = d / "policy-stats.json"
        g = s = "?"
        if ps.is_file():
            p = json.loads(ps.read_text())
            g, s = ("on" if p["guard_on"] else "OFF"), ("on" if p["activation_shift_on"] else "OFF")
        c, h = clean_row(d), hostile_row(d)
        cells = (c[0] if c else ["-"] * 4) + [pf(c[1]) if c else "-"]
        cells += (h[0] if h else ["-"] * 2) + [pf(h[1]) if h else "-"]
        if not c and not h:
            continue
        print(f"| {tag} | {stage} | {g} | {s} | " + " | ".join(cells) + " |")

print("\n## (b) EVA-0 gains over NoAdapt on the corrupted test streams at every batch size\n")
print("NoAdapt / EVA-0 (gain), average over the 15 corruptions at severity 5. user files: "
      "after `tune` (tune1: the tune before 63920ff, step size only); shipped: as shipped.\n")
print("| model | stage | protocol | B=1 | B=4 | B=16 | B=64 | target |")
print("|---|---|---|---|---|---|---|---|")
for tag in tags:
    for stage in ("tune1", "tune", "shipped", "calibrate"):
        d = R / f"{tag}-{stage}"
        for protocol in ("continual", "single"):
            r = corr_row(d, protocol)
            if r:
                print(f"| {tag} | {stage} | {protocol} | " + " | ".join(r[0]) + f" | {pf(r[1])} |")
