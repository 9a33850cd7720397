"""The CUDA-graph table of a probe log (probe.py's output, gpu_check.sh's ``graphs.txt``): per
model, batch and call, ms per call with ORT's CUDA graphs off and on, and their ratio.

    python studies/device-step/graphs_table.py RESULTS/graphs.txt   # writes graphs.md beside it
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MODEL = re.compile(r"^(\S+)\.onnx B=(\d+): cupy-bound logits")
CALL = re.compile(r"^  (.+?) cuda_graph=(True|False): ([0-9.]+) ms/call, replay equal (\w+)")


def table(log: str) -> str:
    """The markdown table of one probe log."""
    rows: dict[tuple[str, int, str], dict[bool, float]] = {}
    model, batch = "", 0
    for line in log.splitlines():
        if found := MODEL.match(line):
            model, batch = Path(found[1]).name.removesuffix("-seed0"), int(found[2])
        elif found := CALL.match(line):
            if found[4] != "True":
                raise ValueError(f"a replay differed from its capture: {line!r}")
            rows.setdefault((model, batch, found[1]), {})[found[2] == "True"] = float(found[3])
    lines = ["| model | B | call | ms, graphs off | ms, graphs on | on / off |",
             "|---|---|---|---|---|---|"]
    for (name, size, call), ms in rows.items():
        lines.append(f"| {name} | {size} | {call} | {ms[False]:.3f} | {ms[True]:.3f} | "
                     f"{ms[True] / ms[False]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    text = table(source.read_text())
    source.with_suffix(".md").write_text(text + "\n")
    print(text)
