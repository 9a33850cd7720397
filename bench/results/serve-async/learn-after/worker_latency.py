"""One image per request through ``AdaptationWorker`` in-process (no HTTP): the median latency
(us) of NoAdapt, noadapt-shift and the asynchronous EVA-0 worker at budgets 1 (never a pass)
and 1.5, six interleaved rounds of 1000 Gaussian-noise severity-5 test images each.

    python bench/results/serve-async/learn-after/worker_latency.py
"""

import os
import time

import numpy as np

from eva0_edge.bench.serve_load import read_metadata, stream_images
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.server.worker import AdaptationWorker

MODEL = "models/resnet_gn_fmnist.onnx"


def started(method: str, config: dict | None, asynchronous: bool) -> AdaptationWorker:
    model = load_method(MODEL, method, config, 0, "cpu", 1)
    worker = AdaptationWorker(model, 64, 0.010, asynchronous=asynchronous)
    worker.start()
    return worker


def main() -> None:
    images = stream_images(read_metadata(MODEL), "gaussian_noise", 1)
    workers = {"noadapt": started("noadapt", None, False),
               "noadapt-shift": started("noadapt-shift", None, False),
               "async@1": started("eva0", {"budget": 1.0}, True),
               "async@1.5": started("eva0", {"budget": 1.5}, True)}
    medians: dict[str, list[float]] = {name: [] for name in workers}
    for round_index in range(6):
        for name, worker in workers.items():
            latencies = []
            for i in range(1000):
                x = images[(round_index * 1000 + i) % len(images)][None]
                start = time.perf_counter()
                worker.submit(x).result()
                latencies.append(time.perf_counter() - start)
            medians[name].append(float(np.median(latencies)) * 1e6)
    for worker in workers.values():
        worker.stop()
    for name, values in medians.items():
        print(f"{name:14s}", " ".join(f"{v:5.0f}" for v in values),
              f"us  median {np.median(values):.0f}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
