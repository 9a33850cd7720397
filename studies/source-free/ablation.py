"""Ablation of the source-free mode (issue 48 item 2): one eval per (method, overrides) row on
the validation split, continual protocol, severity 5, batch 16, 200 images per corruption; one
JSON line per row (the corrupted average and the final drift).

    python studies/source-free/ablation.py models/vit_fmnist.onnx ROWS_JSON [SPEC_JSON]

ROWS_JSON: ``[["eva0-dagger", {"eta": 0.064}], ...]``; SPEC_JSON overrides ``split``,
``protocol``, ``batch``, ``limit``, ``corruptions`` (e.g. ``{"protocol": "single",
"corruptions": ["clean"], "limit": 1000, "batch": 1}``). The rows of the README's table are
in ``ROWS`` (``--table MODEL``)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate
from eva0_edge.runtime.registry import SOURCE_FREE_SHIFT
from eva0_edge.runtime.session import SessionSettings

# the source activation shift each shipped file's eva0 was tuned with (its tuned values)
SOURCE_SHIFT = {
    "vit_fmnist": {"activation_shift": 1.5, "shift_window": 256.0, "shift_max": 11.71},
    "resnet_gn_fmnist": {"activation_shift": 2.0, "shift_window": 256.0, "shift_max": 3.207},
    "mobilenet_bn_fmnist": {"activation_shift": 2.0, "shift_window": 256.0, "shift_max": 3.359},
}
PAPER = {"free_shift": 0.0}  # eva0-dagger as the paper has it: E_SR only


def rows_for(stem: str, eta: float) -> list[tuple[str, dict[str, Any]]]:
    """The README's rows for a model whose eva0 step size is ``eta``."""
    return [
        ("noadapt", {}), ("noadapt-shift", {}), ("eva0", {}), ("eva0", {"activation_shift": 0.0}),
        ("eva0-dagger", PAPER), ("eva0-dagger", {**PAPER, "eta": 4 * eta}),
        ("eva0-dagger", {**PAPER, "eta": 16 * eta}),
        ("eva0-dagger", {**PAPER, "eta": 16 * eta, "gamma": 0.0, "anchor_per_64": 0.0}),
        ("eva0-dagger", {**PAPER, **SOURCE_SHIFT[stem]}),
        ("noadapt", {**SOURCE_FREE_SHIFT, "free_shift_margin": 0.0}),
        ("noadapt", SOURCE_FREE_SHIFT),
        ("eva0-dagger", {}),
    ]


def run(model: str, rows: list[tuple[str, dict[str, Any]]], split: str = "val",
        protocol: str = "continual", batch: int = 16, limit: int = 200,
        corruptions: list[str] | None = None) -> list[dict[str, Any]]:
    """Evaluate every row; print and return one record per row."""
    out = []
    for method, over in rows:
        start = time.time()
        spec = EvalSpec(model=model, dataset="fmnist-c", protocol=protocol, severity=5,
                        batch_size=batch, methods=[method], limit=limit, split=split,
                        overrides=over, corruptions=corruptions,
                        session=SessionSettings(provider="cpu", threads=1))
        result = evaluate(spec, progress=False)[method]
        stats = result.final_stats or {}
        line = {"model": model.split("/")[-1], "method": method, "set": over, "B": batch,
                "protocol": protocol, "split": split, "limit": limit,
                "avg": round(result.average, 2), "drift": stats.get("drift"),
                "seconds": round(time.time() - start)}
        print(json.dumps(line), flush=True)
        out.append(line)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        from eva0_edge.runtime.policy import Policy

        path = sys.argv[2]
        eta = Policy.load(path, "eva0", provider="cpu").config.eta
        stem = path.rsplit("/", 1)[-1].removesuffix(".onnx")
        run(path, rows_for(stem, eta))
    else:
        kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        run(sys.argv[1], [(m, o) for m, o in json.loads(sys.argv[2])], **kw)
