"""In-process A/B of the asynchronous worker learning from one-image batches in blocks (the
product) against every batch as it comes (``serve_step`` replaced by the controller's
``_step``), beside NoAdapt and noadapt-shift: median us per image, 8 interleaved rounds of 1000
Gaussian-noise severity-5 test images, no HTTP.

    python studies/serve-blocks/worker_ab.py
"""

import os
import time

import numpy as np

from eva0_edge.bench.serve_load import read_metadata, stream_images
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.server.worker import AdaptationWorker
from eva0_edge.runtime.session import SessionSettings

MODEL = "models/resnet_gn_fmnist.onnx"


def started(method: str, config: dict | None, asynchronous: bool,
            every_batch: bool = False) -> AdaptationWorker:
    model = load_method(MODEL, method, config, 0, SessionSettings("cpu", 1))
    worker = AdaptationWorker(model, 64, 0.010, asynchronous=asynchronous)
    if every_batch:
        control = model  # the policy
        control.serve_step = lambda x: control._step(x, adapt=False)
    worker.start()
    return worker


def main() -> None:
    images = stream_images(read_metadata(MODEL), "gaussian_noise", 1)
    workers = {"noadapt": started("noadapt", None, False),
               "noadapt-shift": started("noadapt-shift", None, False),
               "blocks": started("eva0", {"budget": 1.5}, True),
               "every batch": started("eva0", {"budget": 1.5}, True, every_batch=True)}
    medians: dict[str, list[float]] = {name: [] for name in workers}
    for round_index in range(8):
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
              f" median {np.median(values):.0f}")
    gap = np.array(medians["blocks"]) - np.array(medians["every batch"])
    print("blocks - every batch:", " ".join(f"{d:+.0f}" for d in gap),
          f"median {np.median(gap):+.0f}", "load average", os.getloadavg())


if __name__ == "__main__":
    main()
