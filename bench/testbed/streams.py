"""A corrupted stream served one image per request: the continual stream as one array in stream
order, what a server predicts for it with several clients in flight, and accuracy per domain
(the fleet and asynchronous-serving studies' shared pieces, moved from
``studies/fleet-stream/fleet_stream.py``)."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.http as httpclient

from eva0_edge.runtime.modelfile import read_metadata

from .evaluate import EvalSpec, load_domains
from .protocols import stream_order


def continual_stream(spec: EvalSpec) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(domain names, images [N, C, H, W] preprocessed, labels [N]) in continual order."""
    pre = read_metadata(spec.model).preprocessing
    names, xs, ys = [], [], []
    for domain in load_domains(spec, progress=False):
        ordered = domain.subset(stream_order(domain, "continual", spec.seed))
        for x, y in ordered.batches(256, pre):
            xs.append(x)
            ys.append(y)
            names.extend([domain.name] * len(y))
    return names, np.concatenate(xs), np.concatenate(ys)


def serve_stream(url: str, name: str, x: np.ndarray, clients: int) -> np.ndarray:
    """Predicted class per image, one image per request, ``clients`` in flight."""
    order = itertools.count()
    lock = threading.Lock()
    predicted = np.full(len(x), -1)

    def client_loop(_: int) -> None:
        client = httpclient.InferenceServerClient(url)
        try:
            while True:
                with lock:
                    i = next(order)
                if i >= len(x):
                    return
                tensor = httpclient.InferInput("pixel_values", [1, *x.shape[1:]], "FP32")
                tensor.set_data_from_numpy(x[i : i + 1])
                predicted[i] = client.infer(name, [tensor]).as_numpy("logits").argmax()
        finally:
            client.close()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    return predicted


def per_domain(names: list[str], correct: np.ndarray) -> dict[str, float]:
    domains = list(dict.fromkeys(names))
    labels = np.array(names)
    return {d: 100.0 * float(correct[labels == d].mean()) for d in domains}
