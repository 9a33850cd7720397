"""How big the entropy part of EVA-0's SPSA coefficient is next to the l_SWA part, per model:
EVA-0 (shift off) on the validation continual stream at B = 16, every objective call recorded.

    python studies/source-free/signal_scale.py models/vit_fmnist.onnx [LIMIT]

Prints the mean and median of |c_ent| = |E+ - E-| / (2 mu) and of lambda |c_swa|, their ratio,
and the logits' mean norm, top probability and entropy (fraction of ln K)."""

from __future__ import annotations

import sys

import numpy as np

from eva0_edge.bench.testbed.evaluate import EvalSpec, load_domains
from eva0_edge.runtime import estimator
from eva0_edge.runtime.losses import (
    sample_wise_alignment,
    shortcut_resistant_scores,
    softmax_entropy,
)
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import SessionSettings

RECORD: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
_ORIGINAL = estimator.Objective.__call__


def _recording(self, logits, features, reference, moments, center):
    """The objective, with its entropy and lambda x l_SWA parts per row recorded."""
    cfg = self.config
    scores = shortcut_resistant_scores(logits.astype(np.float64),
                                       np.linalg.norm(reference, axis=1), center, cfg.eps)
    swa = np.zeros(len(logits))
    if self.source_stats is not None and cfg.lambda_swa > 0:
        swa = cfg.lambda_swa * sample_wise_alignment(features, *moments, *self.source_stats,
                                                     cfg.rho, cfg.eps)
    RECORD.append((softmax_entropy(scores), swa, np.asarray(logits, dtype=np.float64)))
    return _ORIGINAL(self, logits, features, reference, moments, center)


def main(model: str, limit: int) -> None:
    estimator.Objective.__call__ = _recording
    md = read_metadata(model)
    spec = EvalSpec(model=model, dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=16, methods=["eva0"], limit=limit, split="val")
    policy = load_method(model, "eva0", {"activation_shift": 0.0}, 0,
                         SessionSettings(provider="cpu", threads=1))
    for domain in load_domains(spec, progress=False):
        for x, _ in domain.batches(16, md.preprocessing):
            policy.step(x)
    mu = policy.config.mu
    pairs = list(zip(RECORD[0::2], RECORD[1::2], strict=True))  # (theta + mu z, theta - mu z)
    c_ent = np.concatenate([np.abs(p[0] - m[0]) for p, m in pairs]) / (2 * mu)
    c_swa = np.concatenate([np.abs(p[1] - m[1]) for p, m in pairs]) / (2 * mu)
    logits = np.concatenate([r[2] for r in RECORD])
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    entropy = -(p * np.log(p + 1e-12)).sum(1).mean() / np.log(logits.shape[1])
    print(f"{md.architecture}: lambda {policy.config.lambda_swa:g}; |c_ent| mean "
          f"{c_ent.mean():.3g} median {np.median(c_ent):.3g}; lambda |c_swa| mean "
          f"{c_swa.mean():.3g} median {np.median(c_swa):.3g}; "
          f"ratio {c_swa.mean() / c_ent.mean():.3g};"
          f" logit norm {np.linalg.norm(logits, axis=1).mean():.3g}, top p {p.max(1).mean():.3f},"
          f" entropy {entropy:.3f} ln K")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100)
