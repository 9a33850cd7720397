"""Which source-free target can stand in for the source mean of the head input: theta0's
logits on every validation domain (severity 5, LIMIT images each) and 1000 clean ones, one
offset per domain (the domain's own mean, no window), accuracy with each target.

    python studies/source-free/offline_targets.py models/vit_fmnist.onnx [LIMIT]

Columns: NoAdapt; the source shift W (m_source - m_test) at strength 1 and 2 (needs the file's
head_input_mean); the source-free centring mean_k(l_bar) - l_bar at strength 1 and 2 (this
study's fix); prior matching (the offset whose mean softmax is uniform, 50 fixed-point steps:
it needs every logit of the window, which the shift's state does not keep)."""

from __future__ import annotations

import sys

import numpy as np

from eva0_edge.bench.testbed.evaluate import EvalSpec, load_domains
from eva0_edge.runtime.head import cached_head
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import AdaptableSession


def _outputs(session, head, md, domains) -> dict[str, tuple[np.ndarray, ...]]:
    """Per domain: logits [N, K], head inputs [N, D], labels [N] at theta0."""
    out = {}
    for domain in domains:
        logits, inputs, labels = [], [], []
        for x, y in domain.batches(64, md.preprocessing):
            lo, fe = session.run(x, np.broadcast_to(md.theta0, (x.shape[0], md.num_params)))
            logits.append(np.asarray(lo, dtype=np.float64))
            inputs.append(head.head_input(fe))
            labels.append(y)
        out[domain.name] = tuple(np.concatenate(v) for v in (logits, inputs, labels))
    return out


def _prior_matching(logits: np.ndarray) -> np.ndarray:
    offset = np.zeros(logits.shape[1])
    for _ in range(50):
        z = logits + offset
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        offset -= np.log(p.mean(0) * logits.shape[1])
    return offset


def main(model: str, limit: int) -> None:
    md = read_metadata(model)
    session = AdaptableSession(model, md, provider="cpu", threads=1)
    head = cached_head(model, md)
    spec = EvalSpec(model=model, dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=16, methods=["noadapt"], limit=limit, split="val")
    domains = _outputs(session, head, md, load_domains(spec, progress=False))
    clean_spec = EvalSpec(**{**spec.__dict__, "corruptions": ["clean"], "limit": 1000})
    clean = _outputs(session, head, md, load_domains(clean_spec, progress=False))["clean"]
    source = md.arrays["head_input_mean"].astype(np.float64)
    target = head.weight @ source + head.bias
    print("source mean logit, centred:", np.round(target - target.mean(), 2))

    def accuracy(logits, labels):
        return 100.0 * float((logits.argmax(1) == labels).mean())

    rows = []
    for name, (logits, inputs, labels) in {**domains, "clean": clean}.items():
        oracle = head.weight @ (source - inputs.mean(0))
        centring = logits.mean(0).mean() - logits.mean(0)
        rows.append((name, *(accuracy(logits + o, labels) for o in (
            0.0, oracle, 2 * oracle, centring, 2 * centring, _prior_matching(logits)))))
    print(f"{'domain':20s} noadapt source1 source2 centre1 centre2 prior")
    for row in rows:
        print(f"{row[0]:20s} " + " ".join(f"{v:7.1f}" for v in row[1:]))
    mean = np.array([r[1:] for r in rows[:-1]]).mean(0)
    print(f"{'corrupted average':20s} " + " ".join(f"{v:7.1f}" for v in mean))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200)
