"""Which change-of-stream signal sees the changes where an EVA-0 step pays, at every severity
(issue 49 item 2), on the validation split only.

Three stages, each cached under ``.cache/change-detector/`` (git-ignored):

    python studies/change-detector/change_detector.py collect --models resnet_gn vit \
        --severities 1 2 3 4 5
    python studies/change-detector/change_detector.py analyse --models resnet_gn vit
    python studies/change-detector/change_detector.py validate --models resnet_gn vit \
        --severities 1 3 5
    python studies/change-detector/change_detector.py report

``collect``: per severity, the continual validation stream (the 15 corruptions, ``DOMAIN``
(500) images each, the same seeded subset of the 5000 validation images in every domain, each
domain a seeded shuffle; ``CLEAN`` (250) clean images after the 5th and the 10th corruption:
16 changes) served at B = 16 by noadapt-shift (one forward per sample) and by full-rate
EVA-0, recording per sample the input descriptors, the head inputs, the served entropy and
correctness, and per EVA-0 step the ZO estimate's signal-to-noise, the alignment and the live
detectors' calls.

``analyse``: every signal replayed offline through a recent-vs-long window z-test with a
threshold sweep (delay, false alarms, share of changes seen), EVA-0's gain over noadapt-shift
after each change, and how each signal's calls relate to it.

``validate``: EVA-0 at budgets 1.5 and 1.25 against full rate on the first ``VAL_DOMAIN``
(300) images of each domain (clean segments 150) with today's detector and with the
recommended one (:data:`RECOMMENDED`, installed by monkeypatching the policy's input detector;
nothing under runtime/ changes).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from eva0_edge.bench.testbed.datasets import CLEAN as CLEAN_NAME
from eva0_edge.bench.testbed.datasets import fmnist_c_domains
from eva0_edge.bench.testbed.protocols import stream_order
from eva0_edge.runtime import inputwatch, policy
from eva0_edge.runtime.inputwatch import describe
from eva0_edge.runtime.losses import softmax_entropy
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.rates import window_factor, windowed_update
from eva0_edge.runtime.session import SessionSettings

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "change-detector"
RESULTS = ROOT / "results" / "change-detector"
MODELS = {"resnet_gn": "models/resnet_gn_fmnist.onnx", "vit": "models/vit_fmnist.onnx",
          "mobilenet_bn": "models/mobilenet_bn_fmnist.onnx"}
SEED = 0
DOMAIN = 500
CLEAN = 250
CLEAN_AFTER = (4, 9)  # clean segments after the 5th and the 10th corruption
VAL_DOMAIN = 300
VAL_CLEAN = 150
BATCH = 16
RECENT = 32
LONG = 512
DETECTION_WINDOW = 256  # a call within this many samples of a change sees it
VALUE_WINDOWS = (64, 128, 256, 512)
SESSION = SessionSettings(threads=1)


# ----------------------------------------------------------------------------- the stream
LONG_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "zoom_blur", "fog", "elastic_transform")
LONG_DOMAIN = 1000  # the long validation stream: 5 corruptions x 1000, no clean segment


def stream_images(severity: int, long: bool = False) -> dict[str, np.ndarray]:
    """uint8 images [N, 32, 32, 3], labels [N], segment id per sample [N] and the segment
    names of the severity's continual validation stream (cached); ``long``: the issue's shape,
    :data:`LONG_CORRUPTIONS` x :data:`LONG_DOMAIN` (every third corruption)."""
    path = CACHE / f"stream-s{severity}{'-long' if long else ''}{_seeded()}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    rng = np.random.default_rng(SEED)
    # another seed's stream is only validated on: its first VAL_DOMAIN per domain
    size, clean_size = (DOMAIN, CLEAN) if SEED == 0 else (VAL_DOMAIN, VAL_CLEAN)
    if long:
        size = LONG_DOMAIN
    indices = np.sort(rng.choice(5000, size, replace=False))
    domains = fmnist_c_domains(severity, "val", indices=indices, progress=False,
                               **({"corruptions": LONG_CORRUPTIONS} if long else {}))
    clean = fmnist_c_domains(severity, "val", corruptions=[CLEAN_NAME], indices=indices,
                             progress=False)[0]
    images, labels, segment, names = [], [], [], []
    for i, domain in enumerate(domains):
        parts = [domain.subset(stream_order(domain, "continual", SEED))]
        if i in CLEAN_AFTER and not long:
            order = stream_order(clean, "continual", SEED + i)[:clean_size]
            parts.append(clean.subset(order))
        for part in parts:
            images.append(part.images)
            labels.append(part.labels)
            segment.append(np.full(len(part), len(names)))
            names.append(part.name)
    out = {"images": np.concatenate(images), "labels": np.concatenate(labels),
           "segment": np.concatenate(segment), "names": np.array(names)}
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(path, **out)
    return out


def _seeded() -> str:
    """The cache names' suffix of a stream seed other than 0."""
    return f"-seed{SEED}" if SEED else ""


def preprocess(images: np.ndarray, model: str) -> np.ndarray:
    from eva0_edge.runtime.data import InputStream

    pre = read_metadata(MODELS[model]).preprocessing
    labels = np.zeros(len(images), dtype=np.int64)
    stream = InputStream([str(i) for i in range(len(images))], labels, images, None, pre)
    return np.concatenate([x for _, x, _ in stream.batches(512)])


def subsample(stream: dict[str, np.ndarray], domain: int, clean: int) -> dict[str, np.ndarray]:
    """The first ``domain`` samples of every corruption segment (``clean`` of a clean one)."""
    keep = []
    for s, name in enumerate(stream["names"]):
        where = np.flatnonzero(stream["segment"] == s)
        keep.append(where[: clean if name == CLEAN_NAME else domain])
    keep = np.concatenate(keep)
    return {"images": stream["images"][keep], "labels": stream["labels"][keep],
            "segment": stream["segment"][keep], "names": stream["names"]}


def change_points(segment: np.ndarray) -> np.ndarray:
    """Sample index where each segment after the first starts."""
    return np.flatnonzero(np.diff(segment)) + 1


# ----------------------------------------------------------------------------- collect
def serve(model: str, method: str, x: np.ndarray, y: np.ndarray,
          config: dict[str, Any] | None = None, record: bool = True) -> dict[str, np.ndarray]:
    """Serve the stream at B = 16; per-sample correct, entropy, head inputs, and per batch the
    live detectors' calls, the input descriptor z^2 and (adapting) the step's statistics."""
    p = load_method(MODELS[model], method, config=config, seed=SEED, session=SESSION)
    engine = p.model
    heads: list[np.ndarray] = []
    steps: list[tuple[float, float, int, int]] = []
    if record and engine.shift is not None:
        learn = engine.forward.learn
        head = engine.shift.head

        def recording_learn(state, features):
            heads.append(head.head_input(features).astype(np.float32))
            return learn(state, features)

        engine.forward.learn = recording_learn
    if record and hasattr(engine, "_update"):
        update = engine._update

        def recording_update(est):
            c = np.asarray(est.coef, dtype=np.float64)
            g = np.asarray(est.grad, dtype=np.float64)
            steps.append((float(g @ g), float((c * c).mean()), c.size, g.size))
            return update(est)

        engine._update = recording_update
    correct, entropy, z2, input_calls, shift_calls, adapted, alignment, snr = (
        [] for _ in range(8))
    for start in range(0, len(x), BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        before_in = p.inputs.changes
        before_shift = engine.shift.changes if engine.shift is not None else 0
        before_steps = len(steps)
        logits = p.step(xb)
        correct.append(logits.argmax(1) == yb)
        entropy.append(softmax_entropy(logits.astype(np.float64)))
        z2.append(np.nan if p.inputs.last_z_squared is None else p.inputs.last_z_squared)
        input_calls.append(p.inputs.changes - before_in)
        shift_calls.append((engine.shift.changes if engine.shift is not None else 0)
                           - before_shift)
        adapted.append(len(steps) > before_steps)
        if len(steps) > before_steps:
            g2, c2, n, dim = steps[-1]
            snr.append(n * g2 / (dim * c2) if c2 > 0 else np.nan)
        else:
            snr.append(np.nan)
        a = engine.alignment() if hasattr(engine, "alignment") else None
        alignment.append(np.nan if a is None else a)
    out = {"correct": np.concatenate(correct), "entropy": np.concatenate(entropy),
           "z2": np.array(z2), "input_calls": np.array(input_calls),
           "shift_calls": np.array(shift_calls), "adapted": np.array(adapted),
           "alignment": np.array(alignment), "snr": np.array(snr),
           "forwards": np.array(p.forwards_per_sample)}
    if heads:
        out["heads"] = np.concatenate(heads)
    return out


def collect(model: str, severity: int) -> None:
    path = CACHE / f"collect-{model}-s{severity}.npz"
    if path.is_file():
        return
    stream = stream_images(severity)
    x = preprocess(stream["images"], model)
    out: dict[str, np.ndarray] = {"labels": stream["labels"], "segment": stream["segment"],
                                  "names": stream["names"]}
    out["descriptors"] = np.concatenate([describe(x[s:s + 512]) for s in range(0, len(x), 512)])
    for method in ("noadapt-shift", "eva0"):
        for key, value in serve(model, method, x, stream["labels"]).items():
            out[f"{method}/{key}"] = value
    np.savez_compressed(path, **out)
    print(f"collected {model} severity {severity}: noadapt-shift "
          f"{100 * out['noadapt-shift/correct'].mean():.2f}, eva0 "
          f"{100 * out['eva0/correct'].mean():.2f}, live input calls "
          f"{int(out['eva0/input_calls'].sum())}, shift calls "
          f"{int(out['eva0/shift_calls'].sum())}", flush=True)


# ----------------------------------------------------------------------------- detectors
class WindowTest:
    """A recent window of ``recent`` and a long one of ``long`` (per-sample EMAs, as
    :mod:`eva0_edge.runtime.inputwatch`) over values [B, D]; :meth:`observe` returns the
    batch's statistic (None while filling) and whether it exceeded ``threshold``.

    ``rule``: ``max`` (the input detector's: the largest per-dimension z^2, recent before the
    long window takes the batch), ``total`` (the shift's: ||m_r - m_l||^2 R / total variance,
    both windows with the batch) or ``diag`` (per-dimension standardised, summed, as a z of
    a chi-square with D degrees of freedom: (sum_d z_d^2 - D) / sqrt(2D)). Statistics are
    compared with threshold^2 (``max``, ``total``) or threshold (``diag``). On a call both
    windows restart (``max``, ``diag``) or only the long one (``total``, as the shift's)."""

    def __init__(self, rule: str, threshold: float, recent: float = RECENT,
                 long: float = LONG) -> None:
        self.rule, self.threshold = rule, threshold
        self.recent, self.long = recent, long
        self.rf, self.lf = window_factor(recent), window_factor(long)
        self.restart(both=True)

    def restart(self, both: bool) -> None:
        self.lm, self.lw = None, 0.0
        if both:
            self.rm, self.rw = None, 0.0

    def observe(self, values: np.ndarray) -> tuple[float | None, bool]:
        values = np.asarray(values, dtype=np.float64)
        if values.ndim == 1:
            values = values[:, None]
        moments = np.concatenate([values, values**2], axis=1)
        width = values.shape[1]
        if self.rm is None:
            self.rm = np.zeros(width)
        if self.lm is None:
            self.lm = np.zeros(2 * width)
        self.rm, self.rw = windowed_update(self.rm, self.rw, values, self.rf)
        if self.rule != "max" and self.rule != "diag":
            self.lm, self.lw = windowed_update(self.lm, self.lw, moments, self.lf)
        stat = self._stat(width)
        if self.rule in ("max", "diag"):
            self.lm, self.lw = windowed_update(self.lm, self.lw, moments, self.lf)
        if stat is None:
            return None, False
        limit = self.threshold if self.rule == "diag" else self.threshold**2
        called = stat > limit
        if called:
            self.restart(both=self.rule != "total")
        return stat, called

    def _stat(self, width: int) -> float | None:
        if self.rw < 1.0 - self.rf**RECENT or self.lw < 1.0 - self.lf**RECENT:
            return None
        mean = self.lm[:width]
        var = np.maximum(self.lm[width:] - mean**2, 0.0)
        gap = (self.rm - mean) ** 2 * RECENT
        if self.rule == "total":
            return float(gap.sum() / (var.sum() + 1e-12 * (1.0 + mean @ mean)))
        z2 = gap / (var + 1e-8 * (1.0 + mean**2))
        if self.rule == "max":
            return float(z2.max())
        return float((z2.sum() - width) / math.sqrt(2.0 * width))


# The signals: name -> (recorded array key, per-sample or per-batch, rule, windows, thresholds)
SIGNALS: dict[str, dict[str, Any]] = {
    "input": {"key": "descriptors", "per": "sample", "rule": "max",
              "recent": RECENT, "long": LONG,
              "grid": [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0], "today": 4.5},
    "features-theta0": {"key": "noadapt-shift/heads", "per": "sample", "rule": "total",
                        "recent": RECENT, "long": 1216,
                        "grid": [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], "today": 3.0},
    "features-eva0": {"key": "eva0/heads", "per": "sample", "rule": "total",
                      "recent": RECENT, "long": 256,
                      "grid": [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], "today": 3.0},
    "features-diag": {"key": "noadapt-shift/heads", "per": "sample", "rule": "diag",
                      "recent": RECENT, "long": LONG,
                      "grid": [5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 80.0]},
    "entropy-theta0": {"key": "noadapt-shift/entropy", "per": "sample", "rule": "max",
                       "recent": RECENT, "long": LONG,
                       "grid": [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0]},
    "entropy-eva0": {"key": "eva0/entropy", "per": "sample", "rule": "max",
                     "recent": RECENT, "long": LONG,
                     "grid": [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0]},
    "alignment": {"key": "eva0/alignment", "per": "batch", "rule": "max",
                  "recent": 2, "long": 32, "grid": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]},
    "zo-snr": {"key": "eva0/snr", "per": "batch", "rule": "max",
               "recent": 2, "long": 32, "grid": [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]},
}


def replay(data: dict[str, np.ndarray], signal: str, threshold: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """(statistic per batch (NaN while filling), called per batch) of ``signal`` replayed."""
    spec = SIGNALS[signal]
    values = data[spec["key"]]
    n = len(data["labels"])
    batches = range(0, n, BATCH)
    recent, long = spec["recent"], spec["long"]
    if spec["per"] == "batch":  # one value per batch, windows in batches
        recent, long = recent, long
    test = WindowTest(spec["rule"], threshold, recent, long)
    if spec["per"] == "batch":  # the fill rule counts RECENT values: rescale to batches
        test.rf, test.lf = window_factor(recent), window_factor(long)
    stats, calls = np.full(len(batches), np.nan), np.zeros(len(batches), dtype=bool)
    for b, start in enumerate(batches):
        if spec["per"] == "sample":
            chunk = values[start:start + BATCH]
        else:
            value = values[b]
            if not np.isfinite(value):
                continue
            chunk = np.array([np.log(max(value, 1e-12)) if signal == "zo-snr" else value])
        stat, called = test.observe(chunk)
        if stat is not None:
            stats[b] = stat
        calls[b] = called
    return stats, calls


def score_calls(calls: np.ndarray, segment: np.ndarray) -> dict[str, Any]:
    """Delay (samples from a change to the end of the calling batch) per change (None: not
    seen within ``DETECTION_WINDOW``), false alarms (every other call) per 1000 samples."""
    n = len(segment)
    ends = np.minimum(np.arange(1, len(calls) + 1) * BATCH, n)
    called_at = ends[calls]
    used = np.zeros(len(called_at), dtype=bool)
    delays: list[int | None] = []
    for c in change_points(segment):
        hit = np.flatnonzero((called_at > c) & (called_at <= c + DETECTION_WINDOW) & ~used)
        if hit.size:
            used[hit[0]] = True
            delays.append(int(called_at[hit[0]] - c))
        else:
            delays.append(None)
    false = int((~used).sum())
    return {"delays": delays, "false_alarms": false,
            "false_per_1000": 1000.0 * false / n}


def step_value(data: dict[str, np.ndarray]) -> dict[str, Any]:
    """EVA-0's gain over noadapt-shift (points) after each change: in the first k samples
    (k in VALUE_WINDOWS, clipped at the segment) and in each bin between them."""
    segment = data["segment"]
    gain = data["eva0/correct"].astype(float) - data["noadapt-shift/correct"].astype(float)
    starts = np.concatenate([[0], change_points(segment)])
    ends = np.concatenate([starts[1:], [len(segment)]])
    first = {k: [] for k in VALUE_WINDOWS}
    bins = {}
    edges = (0, *VALUE_WINDOWS)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        bins[f"{lo}-{hi}"] = []
    for s, e in zip(starts[1:], ends[1:], strict=True):
        for k in VALUE_WINDOWS:
            first[k].append(100 * gain[s:min(e, s + k)].mean())
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            part = gain[s + lo:min(e, s + hi)]
            bins[f"{lo}-{hi}"].append(100 * part.mean() if part.size else np.nan)
    return {"per_change_first": {str(k): v for k, v in first.items()},
            "per_change_bins": bins,
            "first": {str(k): float(np.mean(v)) for k, v in first.items()},
            "bins": {k: float(np.nanmean(v)) if np.isfinite(v).any() else None
                     for k, v in bins.items()},
            "whole": float(100 * gain.mean())}


def load_collected(model: str, severity: int) -> dict[str, np.ndarray] | None:
    path = CACHE / f"collect-{model}-s{severity}.npz"
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def peak_near_change(stats: np.ndarray, segment: np.ndarray, window: int = 64) -> list[float]:
    """Each change's largest statistic in the batches ending within ``window`` samples after
    it (the magnitude a detector sees, whatever its threshold; NaN while filling)."""
    ends = np.minimum(np.arange(1, len(stats) + 1) * BATCH, len(segment))
    out = []
    for c in change_points(segment):
        near = stats[(ends > c) & (ends <= c + window)]
        out.append(float(np.nanmax(near)) if np.isfinite(near).any() else float("nan"))
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    a_, b_ = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a_) & np.isfinite(b_)
    if ok.sum() < 4:
        return None
    ra = np.argsort(np.argsort(a_[ok])).astype(float)
    rb = np.argsort(np.argsort(b_[ok])).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def analyse(models: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    for model in models:
        per_sev: dict[str, Any] = {}
        for severity in range(1, 6):
            data = load_collected(model, severity)
            if data is None:
                continue
            value = step_value(data)
            seg = data["segment"]
            names = list(data["names"])
            kinds = [("clean" if names[seg[c]] == CLEAN_NAME else "corruption")
                     for c in change_points(seg)]
            entry: dict[str, Any] = {
                "accuracy": {"noadapt-shift": float(100 * data["noadapt-shift/correct"].mean()),
                             "eva0": float(100 * data["eva0/correct"].mean())},
                "value": value, "change_to": kinds, "signals": {},
                "live_eva0": {
                    "input": score_calls(data["eva0/input_calls"] > 0, seg),
                    "shift": score_calls(data["eva0/shift_calls"] > 0, seg),
                    "either": score_calls((data["eva0/input_calls"] > 0)
                                          | (data["eva0/shift_calls"] > 0), seg)},
            }
            gains = value["per_change_first"]["256"]
            for signal, spec in SIGNALS.items():
                if spec["key"] not in data:
                    continue
                rows = {}
                stats_today = None
                for threshold in spec["grid"]:
                    stats, calls = replay(data, signal, threshold)
                    score = score_calls(calls, seg)
                    score["calls"] = calls
                    rows[str(threshold)] = score
                    if stats_today is None:
                        stats_today = stats
                peaks = peak_near_change(stats_today, seg)
                entry["signals"][signal] = {
                    "thresholds": rows, "peak_z2_64": peaks,
                    "spearman_peak_vs_gain256": spearman(peaks, gains)}
            per_sev[str(severity)] = entry
        out["models"][model] = per_sev
    return out


def summarise(score: dict[str, Any]) -> dict[str, Any]:
    delays = [d for d in score["delays"] if d is not None]
    return {"seen": len(delays), "changes": len(score["delays"]),
            "median_delay": float(np.median(delays)) if delays else None,
            "false_per_1000": round(score["false_per_1000"], 3)}


FALSE_ALARM_LIMIT = 0.25  # per 1000 samples, pooled over models and severities


def operating_threshold(analysis: dict[str, Any], signal: str) -> float | None:
    """The lowest threshold of ``signal``'s grid whose false alarms, pooled over every model
    and severity collected, stay at or under ``FALSE_ALARM_LIMIT`` per 1000 samples."""
    for threshold in SIGNALS[signal]["grid"]:
        rates = [sev["signals"][signal]["thresholds"][str(threshold)]["false_per_1000"]
                 for per_sev in analysis["models"].values() for sev in per_sev.values()
                 if signal in sev["signals"]]
        if rates and float(np.mean(rates)) <= FALSE_ALARM_LIMIT:
            return threshold
    return None


def relation(sev: dict[str, Any], score: dict[str, Any]) -> dict[str, Any]:
    """The step's value (gain in the first 64 and 256 samples) at the changes a detector's
    calls see and at those they miss."""
    seen = np.array([d is not None for d in score["delays"]])
    out: dict[str, Any] = {}
    for k in ("64", "256"):
        gains = np.array(sev["value"]["per_change_first"][k])
        out[f"gain{k}_seen"] = float(gains[seen].mean()) if seen.any() else None
        out[f"gain{k}_missed"] = float(gains[~seen].mean()) if (~seen).any() else None
    return out


def build_summary(analysis: dict[str, Any]) -> dict[str, Any]:
    operating = {s: SIGNALS[s].get("today") for s in SIGNALS}
    chosen = {s: operating_threshold(analysis, s) for s in SIGNALS}
    rows = []
    for model, per_sev in analysis["models"].items():
        for severity, sev in per_sev.items():
            row: dict[str, Any] = {"model": model, "severity": int(severity),
                                   "accuracy": sev["accuracy"], "value": {
                                       k: sev["value"][k] for k in ("first", "bins", "whole")},
                                   "live_eva0": {k: summarise(v)
                                                 for k, v in sev["live_eva0"].items()},
                                   "signals": {}}
            for signal, entry in sev["signals"].items():
                cell = {}
                for label, threshold in (("today", operating[signal]),
                                         ("fa-limited", chosen[signal])):
                    if threshold is None:
                        continue
                    score = entry["thresholds"][str(threshold)]
                    cell[label] = {"threshold": threshold, **summarise(score),
                                   **relation(sev, score)}
                cell["sweep"] = {t: summarise(v) for t, v in entry["thresholds"].items()}
                cell["spearman_peak_vs_gain256"] = entry["spearman_peak_vs_gain256"]
                row["signals"][signal] = cell
            rows.append(row)
    return {"operating_thresholds": {"today": operating, "fa_limited": chosen,
                                     "false_alarm_limit_per_1000": FALSE_ALARM_LIMIT},
            "rows": rows}


def _fmt(x: float | None, spec: str = "+.2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else \
        format(x, spec)


def validation_lines(validation: dict[tuple[str, int, int], dict[str, Any]], what: str
                     ) -> list[str]:
    """The validation table's lines (none without runs)."""
    lines: list[str] = []
    if validation:
        lines += ["", f"## Validation: EVA-0 at budgets 1.5 / 1.25 against full rate ({what})",
                  "", "Accuracy over the stream (%), mean over the seeds (stream and method "
                  "seed); gap = budget - today's full rate, mean (standard error over seeds); "
                  "[gap to the same detector's full rate]; forwards per sample in (); "
                  "input calls at 1.5, mean.", "",
                  "| model | sev | seeds | detector | full | 1.5 | gap 1.5 | 1.25 | gap 1.25 | "
                  "calls |", "|---|---|---|---|---|---|---|---|---|---|"]
        groups: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        for (model, severity, seed), runs in validation.items():
            groups.setdefault((model, severity), {})[seed] = runs
        for (model, severity), seeds in sorted(groups.items()):
            for name in CANDIDATES:
                have = [r for r in seeds.values() if f"{name}/1.5" in r and f"{name}/1.25" in r
                        and "today/full" in r]
                if not have:
                    continue
                full = [r.get(f"{name}/full", r["today/full"])["accuracy"] for r in have]
                cells = []
                for b in ("1.5", "1.25"):
                    acc = [r[f"{name}/{b}"]["accuracy"] for r in have]
                    gap = [a - r["today/full"]["accuracy"] for a, r in zip(acc, have,
                                                                           strict=True)]
                    own = [a - f for a, f in zip(acc, full, strict=True)]
                    fwd = np.mean([r[f"{name}/{b}"]["forwards_per_sample"] for r in have])
                    se = np.std(gap, ddof=1) / math.sqrt(len(gap)) if len(gap) > 1 else None
                    cells += [f"{np.mean(acc):.2f} ({fwd:.2f})",
                              f"{np.mean(gap):+.2f} ({_fmt(se, '.2f')}) [{np.mean(own):+.2f}]"]
                calls = np.mean([r[f"{name}/1.5"]["input_calls"] for r in have])
                lines.append(f"| {model} | {severity} | {len(have)} | {name} | "
                             f"{np.mean(full):.2f} | " + " | ".join(cells) + f" | {calls:.1f} |")
    return lines


def markdown(summary: dict[str, Any], validation: dict[tuple[str, int, int], dict[str, Any]],
             long_validation: dict[tuple[str, int, int], dict[str, Any]]) -> str:
    chosen = summary["operating_thresholds"]["fa_limited"]
    lines = ["# Change detectors by severity (validation split)", "",
             f"Operating thresholds: today's (input z 4.5, shift z 3.0) and, per signal, the "
             f"lowest of its sweep with pooled false alarms <= "
             f"{FALSE_ALARM_LIMIT} per 1000 samples: "
             + ", ".join(f"{s} {t}" for s, t in chosen.items()) + ".", "",
             "## Detection: seen / 16 changes, median delay (samples), false alarms per 1000",
             "", "| model | sev | " + " | ".join(
                 f"{s} @{t}" for s in SIGNALS for t in
                 dict.fromkeys(x for x in (SIGNALS[s].get("today"), chosen[s])
                               if x is not None)) + " | live input+shift (eva0) |",
             ]
    ncol = sum(len(dict.fromkeys(x for x in (SIGNALS[s].get("today"), chosen[s])
                                 if x is not None)) for s in SIGNALS)
    lines.append("|---|---|" + "---|" * (ncol + 1))
    for row in summary["rows"]:
        cells = []
        for s in SIGNALS:
            for t in dict.fromkeys(x for x in (SIGNALS[s].get("today"), chosen[s])
                                   if x is not None):
                c = row["signals"].get(s, {}).get("sweep", {}).get(str(t))
                cells.append("-" if c is None else
                             f"{c['seen']}, {_fmt(c['median_delay'], '.0f')}, "
                             f"{c['false_per_1000']:.2f}")
        live = row["live_eva0"]["either"]
        lines.append(f"| {row['model']} | {row['severity']} | " + " | ".join(cells) +
                     f" | {live['seen']}, {_fmt(live['median_delay'], '.0f')}, "
                     f"{live['false_per_1000']:.2f} |")
    lines += ["", "## The value of a step: EVA-0 minus noadapt-shift (points) after a change",
              "", "| model | sev | first 64 | first 128 | first 256 | first 512 (to the "
              "segment's end) | 0-64 | 64-128 | 128-256 | 256-512 | whole stream |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        v = row["value"]
        lines.append(f"| {row['model']} | {row['severity']} | " + " | ".join(
            _fmt(v["first"][k]) for k in ("64", "128", "256", "512")) + " | " + " | ".join(
            _fmt(v["bins"][k]) for k in ("0-64", "64-128", "128-256", "256-512")) +
            f" | {_fmt(v['whole'])} |")
    lines += ["", "## Which calls come where a step pays: mean gain (points) in the first "
              "64 / 256 samples at the changes a signal sees and at those it misses", "",
              "| model | sev | signal @threshold | seen | gain64 seen | gain64 missed | "
              "gain256 seen | gain256 missed | Spearman(peak stat in 64, gain256) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        for s, cell in row["signals"].items():
            for label in ("today", "fa-limited"):
                c = cell.get(label)
                if c is None or (label == "fa-limited" and cell.get("today") and
                                 cell["today"]["threshold"] == c["threshold"]):
                    continue
                lines.append(
                    f"| {row['model']} | {row['severity']} | {s} @{c['threshold']} | "
                    f"{c['seen']} | {_fmt(c['gain64_seen'])} | {_fmt(c['gain64_missed'])} | "
                    f"{_fmt(c['gain256_seen'])} | {_fmt(c['gain256_missed'])} | "
                    f"{_fmt(cell['spearman_peak_vs_gain256'])} |")
    lines += validation_lines(validation, f"{VAL_DOMAIN} per corruption, {VAL_CLEAN} per "
                              f"clean segment after the 5th and 10th, B {BATCH}")
    lines += validation_lines(long_validation, f"the long stream: {', '.join(LONG_CORRUPTIONS)}"
                              f" x {LONG_DOMAIN}, no clean segment, B {BATCH}")
    return "\n".join(lines) + "\n"


def load_validation(long: bool = False) -> dict[tuple[str, int, int], dict[str, Any]]:
    out = {}
    for path in sorted(CACHE.glob("validate-*-s*.json")):
        if path.stem.startswith("validate-long-") != long:
            continue
        if long:
            path_stem = path.stem.replace("validate-long-", "validate-")
        else:
            path_stem = path.stem
        name, _, seed = path_stem[len("validate-"):].partition("-seed")
        model, severity = name.rsplit("-s", 1)
        out[model, int(severity), int(seed or 0)] = json.loads(path.read_text())
    return out


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.cm.viridis(np.linspace(0, 0.9, 5))
    for row in summary["rows"]:
        if row["model"] != "resnet_gn":
            continue
        sev = row["severity"]
        sweep = row["signals"]["input"]["sweep"]
        ts = [float(t) for t in sweep]
        axes[0].plot(ts, [sweep[t]["seen"] / sweep[t]["changes"] for t in sweep], "o-",
                     color=colors[sev - 1], label=f"severity {sev}")
    axes[0].axvline(4.5, color="grey", ls="--")
    axes[0].set(xlabel="input detector threshold (z)", ylabel="share of the 16 changes seen",
                title="input descriptors: changes seen")
    axes[0].legend()
    for row in summary["rows"]:
        if row["model"] != "resnet_gn":
            continue
        sev = row["severity"]
        for signal, marker in (("input", "o"), ("features-diag", "s"),
                               ("entropy-theta0", "^"), ("alignment", "v")):
            sweep = row["signals"].get(signal, {}).get("sweep", {})
            axes[1].plot([sweep[t]["false_per_1000"] for t in sweep],
                         [sweep[t]["seen"] / sweep[t]["changes"] for t in sweep],
                         marker=marker, color=colors[sev - 1], ls="-", lw=0.8,
                         label=signal if sev == 1 else None)
    axes[1].set(xlabel="false alarms per 1000 samples", ylabel="share seen", xlim=(-0.05, 1.5),
                title="ResNet-GN: seen vs false alarms (o input, s features-diag, ^ entropy, "
                      "v alignment)")
    axes[1].title.set_fontsize(8)
    axes[1].legend(fontsize=7)
    centres = [32, 96, 192, 384]
    for row in summary["rows"]:
        bins = row["value"]["bins"]
        axes[2].plot(centres, [bins[k] if bins[k] is not None else np.nan for k in bins],
                     "o-" if row["model"] == "resnet_gn" else "s--",
                     color=colors[row["severity"] - 1], lw=1,
                     label=f"{row['model']} s{row['severity']}"
                     if row["model"] in ("resnet_gn", "vit") else None)
    axes[2].axhline(0, color="grey", lw=0.5)
    axes[2].set(xticks=centres, xlabel="samples after a change (bin centre)",
                ylabel="EVA-0 - noadapt-shift (points)",
                title="value of a step after a change (o ResNet-GN, s ViT)")
    axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(models: list[str]) -> None:
    analysis = analyse(models)
    summary = build_summary(analysis)
    validation = load_validation()
    long_validation = load_validation(long=True)
    summary["validation"] = {f"{m}/s{s}/seed{k}": v
                             for (m, s, k), v in sorted(validation.items())}
    summary["protocol"] = {"seed": SEED, "domain": DOMAIN, "clean": CLEAN,
                           "clean_after": list(CLEAN_AFTER), "batch": BATCH,
                           "detection_window": DETECTION_WINDOW, "val_domain": VAL_DOMAIN,
                           "val_clean": VAL_CLEAN, "candidates": CANDIDATES,
                           "recommended": RECOMMENDED,
                           "signals": {s: {k: v for k, v in spec.items()}
                                       for s, spec in SIGNALS.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "change_detector.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["validation_long"] = {f"{m}/s{s}/seed{k}": v
                                  for (m, s, k), v in sorted(long_validation.items())}
    table = markdown(summary, validation, long_validation)
    (RESULTS / "change_detector.md").write_text(table)
    plot(summary, RESULTS / "change_detector.png")
    print(table)


# ----------------------------------------------------------------------------- validate
# The detectors validate compares: today's (None), the input detector's CHANGE_Z lowered
# ("input_z": every use of a call: the budget's dense phase, the guard's audit at a change, the
# shift's restart), and today's detector plus a second one on the same descriptors at a lower
# threshold that only makes the budget spend densely ("dense_z": no audit, no restart).
CANDIDATES: dict[str, dict[str, float] | None] = {
    "today": None, "input-3.5": {"input_z": 3.5}, "input-3.0": {"input_z": 3.0},
    "dense-3.0": {"dense_z": 3.0},
}
RECOMMENDED = "dense-3.0"


def install(detector: dict[str, float] | None) -> tuple[Any, ...]:
    """Monkeypatch the runtime for ``detector``; returns what :func:`uninstall` restores."""
    saved = (inputwatch.CHANGE_Z, policy.Policy._inputs_changed)
    if detector is None:
        return saved
    if "input_z" in detector:
        inputwatch.CHANGE_Z = detector["input_z"]
    if "dense_z" in detector:
        original, threshold = policy.Policy._inputs_changed, detector["dense_z"]

        def inputs_changed(self, x):
            changed = original(self, x)
            if self.budget is None:
                return changed
            dense = getattr(self, "_study_dense", None)
            if dense is None:
                dense = self._study_dense = WindowTest("max", threshold)
            if dense.observe(describe(x))[1] and not changed:
                self.budget.changed()
            return changed

        policy.Policy._inputs_changed = inputs_changed
    return saved


def uninstall(saved: tuple[Any, ...]) -> None:
    inputwatch.CHANGE_Z, policy.Policy._inputs_changed = saved


def run_budget(model: str, x: np.ndarray, y: np.ndarray, segment: np.ndarray,
               budget: float | None, detector: dict[str, float] | None) -> dict[str, Any]:
    saved = install(detector)
    try:
        config = None if budget is None else {"budget": budget}
        result = serve(model, "eva0", x, y, config=config, record=False)
    finally:
        uninstall(saved)
    correct = result["correct"]
    return {"accuracy": float(100 * correct.mean()),
            "domain_average": float(np.mean([100 * correct[segment == s].mean()
                                             for s in np.unique(segment)])),
            "forwards_per_sample": float(result["forwards"]),
            "input_calls": int(result["input_calls"].sum())}


def validate(model: str, severity: int, candidates: list[str], long: bool = False
             ) -> dict[str, Any]:
    tag = "long-" if long else ""
    path = CACHE / f"validate-{tag}{model}-s{severity}{_seeded()}.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    stream = stream_images(severity, long) if long else \
        subsample(stream_images(severity), VAL_DOMAIN, VAL_CLEAN)
    x = preprocess(stream["images"], model)
    for name in candidates:
        detector = CANDIDATES[name]
        for budget in (None, 1.5, 1.25):
            key = f"{name}/{'full' if budget is None else budget}"
            if key in done or (budget is None and detector is not None
                               and "input_z" not in detector):
                continue  # without a budget a dense-only detector changes nothing
            done[key] = run_budget(model, x, stream["labels"], stream["segment"], budget,
                                   detector)
            print(model, severity, key, done[key], flush=True)
            path.write_text(json.dumps(done, indent=1))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("collect", "analyse", "validate", "report"))
    parser.add_argument("--models", nargs="+", default=["resnet_gn"], choices=list(MODELS))
    parser.add_argument("--severities", nargs="+", type=int, default=[1, 3, 5])
    parser.add_argument("--seed", type=int, default=0,
                        help="stream and method seed of validate (collect: 0 only)")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                        choices=list(CANDIDATES), help="the detectors validate runs")
    parser.add_argument("--long", action="store_true", help="validate on the long stream "
                        f"({len(LONG_CORRUPTIONS)} corruptions x {LONG_DOMAIN})")
    args = parser.parse_args(argv)
    global SEED
    SEED = args.seed
    if args.stage != "validate" and SEED:
        parser.error("--seed is for validate only")
    if args.stage == "collect":
        for severity in args.severities:
            for model in args.models:
                collect(model, severity)
    elif args.stage == "report":
        report(args.models)
    elif args.stage == "validate":
        for severity in args.severities:
            for model in args.models:
                validate(model, severity, args.candidates, args.long)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
