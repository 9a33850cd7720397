"""Which computation is the one-forward tier? Four candidates on the validation split.

* ``strength1``: the old noadapt-shift: FOA's activation shift at strength 1 over 1216
  samples, unbounded, windows never restarted by the input change detector;
* ``strength1+detector``: the same with the input change detector restarting the shift's
  windows at a change of stream;
* ``eva0-shift``: the shift as tuned for eva0 in the model file (strength, window, bound),
  no detector;
* ``eva0-shift+detector``: eva0 at ``--budget 1`` before issue 49: eva0's shift and the
  detector (now noadapt-shift too).

    python studies/one-forward-tier/tier.py --out results/one-forward-tier

Writes ``tier.jsonl`` (one line per model, protocol, severity, batch size and candidate) and
prints the table of averages.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eva0_edge.bench.testbed.datasets import fmnist_c_domains
from eva0_edge.bench.testbed.protocols import run_protocol
from eva0_edge.runtime.config import SHIFT_KEYS
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import SessionSettings

STRENGTH1 = {"activation_shift": 1.0, "shift_window": 1216.0, "shift_max": None}


class EngineServe:
    """A method served by the engine alone (no policy: no input change detector)."""

    def __init__(self, model: str, config: dict) -> None:
        self.policy = load_method(model, "noadapt-shift", config, 0, SessionSettings(threads=1))

    def step(self, x: np.ndarray) -> np.ndarray:
        engine = self.policy.model
        return engine.serve(engine.session.check_input(x))[0]

    def reset(self) -> None:
        self.policy.reset()


def candidates(model: str) -> dict:
    tuned = read_metadata(model).tuned.get("eva0", {})
    eva0_shift = {k: tuned.get(k) for k in SHIFT_KEYS}
    policy = lambda config: lambda: load_method(  # noqa: E731
        model, "noadapt-shift", config, 0, SessionSettings(threads=1))
    return {
        "strength1": lambda: EngineServe(model, STRENGTH1),
        "strength1+detector": policy(STRENGTH1),
        "eva0-shift": lambda: EngineServe(model, eva0_shift),
        "eva0-shift+detector": policy(eva0_shift),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet_gn_fmnist,vit_fmnist,mobilenet_bn_fmnist")
    parser.add_argument("--protocols", default="continual,single,imbalanced")
    parser.add_argument("--severities", default="1,3,5")
    parser.add_argument("--batch-sizes", default="16")
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    indices = np.sort(np.random.default_rng(0).choice(5000, args.limit, replace=False))
    lines = []
    for severity in map(int, args.severities.split(",")):
        domains = fmnist_c_domains(severity, "val", indices=indices, progress=False)
        for name in args.models.split(","):
            model = f"models/{name}.onnx"
            pre = read_metadata(model).preprocessing
            for protocol in args.protocols.split(","):
                for batch in map(int, args.batch_sizes.split(",")):
                    row = {"model": name, "protocol": protocol, "severity": severity,
                           "batch": batch}
                    for label, make in candidates(model).items():
                        result = run_protocol(label, make, domains, protocol, batch, pre, 0,
                                              progress=False)
                        row[label] = round(result.average, 3)
                    lines.append(row)
                    print(json.dumps(row), flush=True)
    (args.out / "tier.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
