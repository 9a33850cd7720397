"""Which lowering of an affine-free GroupNorm does ORT CPU run fastest? (the exporter's choice)

Exports one norm over ResNet50-GN's layer shapes three ways at opset 18, times them in ONNX
Runtime interleaved, and reports medians:

* ``groupnorm``: ``F.group_norm`` (dynamo emits GroupNormalization + ones/zeros affine);
* ``instancenorm``: reshape to [N, G, -1, 1] + ``F.instance_norm`` (the pre-opset-18 pattern);
* ``layernorm``: reshape to [N, G, -1] + ``F.layer_norm`` over the last dim (our lowering).

    python studies/gn-lowering/gn_lowering.py --out out/gn
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

from eva0_edge.bench.testbed.output import pyplot, save_figure, write_outputs
from eva0_edge.runtime.session import session_options

SHAPES = [(256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)]
GROUPS = 32


class Lowered(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.how == "groupnorm":
            return F.group_norm(x, GROUPS, None, None, 1e-5)
        if self.how == "instancenorm":
            y = F.instance_norm(x.reshape(n, GROUPS, -1, 1), eps=1e-5)
            return y.reshape(x.shape)
        y = x.reshape(n, GROUPS, -1)
        return F.layer_norm(y, y.shape[-1:], None, None, 1e-5).reshape(x.shape)


def export(how: str, shape: tuple[int, int, int], path: Path) -> None:
    x = torch.randn(2, *shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Lowered(how), (x,), str(path), input_names=["x"],
                          dynamic_shapes={"x": {0: torch.export.Dim("n")}},
                          opset_version=18, dynamo=True, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="out/gn-lowering")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ways = ("groupnorm", "instancenorm", "layernorm")
    rows = []
    for shape in SHAPES:
        sessions, x = {}, np.random.default_rng(0).standard_normal(
            (args.batch, *shape)).astype(np.float32)
        for how in ways:
            path = out / f"{how}-{shape[0]}.onnx"
            export(how, shape, path)
            sessions[how] = ort.InferenceSession(str(path), session_options(),
                                                 providers=["CPUExecutionProvider"])
        reference = sessions["groupnorm"].run(None, {"x": x})[0]
        times = {how: [] for how in ways}
        for _ in range(3):
            for how in ways:
                sessions[how].run(None, {"x": x})
        for _ in range(args.repeats):
            for how in ways:
                start = time.perf_counter()
                y = sessions[how].run(None, {"x": x})[0]
                times[how].append(time.perf_counter() - start)
                assert np.allclose(y, reference, atol=1e-4), how
        base = float(np.median(times["groupnorm"]))
        for how in ways:
            median = float(np.median(times[how]))
            rows.append({"shape": list(shape), "lowering": how, "ms": 1000 * median,
                         "x_groupnorm": median / base})
    report = {"batch": args.batch, "repeats": args.repeats, "onnxruntime": ort.__version__,
              "load_average": os.getloadavg(), "rows": rows}
    lines = ["| shape | lowering | ms | x GroupNormalization |", "|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['lowering']} | {r['ms']:.3f} | {r['x_groupnorm']:.2f} |"
              for r in rows]
    table = "\n".join(lines)
    print(table)
    write_outputs(out, "gn_lowering", report, table + "\n", lambda _, path: _plot(rows, path))


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    shapes = list(dict.fromkeys(str(r["shape"]) for r in rows))
    for i, how in enumerate(("groupnorm", "instancenorm", "layernorm")):
        values = [r["ms"] for r in rows if r["lowering"] == how]
        ax.bar(np.arange(len(shapes)) + 0.27 * (i - 1), values, 0.27, label=how)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("ms per call")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
