"""Where the asynchronous server's served path spends its time on one image: the EVA-0 worker's
``serve_step`` at budget 1.5 on the shipped ResNet-GN, 4000 Gaussian-noise severity-5 test
images one at a time (after 500 untimed), each part's mean microseconds per image, timed by
wrapping it in place (so the numbers are what the part costs between ORT calls, caches as they
are there). ``--batch B`` serves batches of B images instead (as thirteen clients' requests
coalesce), each part then per batch, beside NoAdapt's ``step`` on the same batches,
interleaved.

    python studies/serve-learn-after/served_path.py [--batch 13]
"""

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

from eva0_edge.bench.serve_load import read_metadata, stream_images
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.session import SessionSettings

MODEL = "models/resnet_gn_fmnist.onnx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    batch = parser.parse_args().batch
    images = stream_images(read_metadata(MODEL), "gaussian_noise", 1)
    model = load_method(MODEL, "eva0", {"budget": 1.5}, 0, SessionSettings("cpu", 1))
    model.set_asynchronous()
    control = model  # the policy: serve_step, inputs, _after_change
    seconds: dict[str, float] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        part: Callable = getattr(owner, name)

        @functools.wraps(part)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return part(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(model.session, "run", "ORT call (the forward)")
    timed(model.session, "check_input", "input check")
    timed(control.inputs, "observe", "input change detector")
    timed(model.shift, "offset", "activation shift: offset")
    timed(model.shift, "observe", "activation shift: window")
    timed(control, "_after_change", "guard and budget after the batch")
    if batch == 1:
        for i in range(500):
            control.serve_step(images[i][None])
        seconds.clear()
        count = 4000
        start = time.perf_counter()
        for i in range(500, 500 + count):
            control.serve_step(images[i][None])
        total = time.perf_counter() - start
    else:
        noadapt = load_method(MODEL, "noadapt", None, 0, SessionSettings("cpu", 1))
        batches = [images[a:a + batch] for a in range(0, len(images) - batch + 1, batch)]
        for x in batches[:40]:
            control.serve_step(x)
        seconds.clear()
        total = reference = 0.0
        for x in batches[40:]:
            start = time.perf_counter()
            control.serve_step(x)
            middle = time.perf_counter()
            noadapt.step(x)
            total += middle - start
            reference += time.perf_counter() - middle
        count = len(batches) - 40
    unit = "us" if batch == 1 else f"us a batch of {batch}"
    for label, spent in seconds.items():
        print(f"{label:34s} {spent / count * 1e6:7.1f} {unit}")
    print(f"{'the rest (controller, copies)':34s} "
          f"{(total - sum(seconds.values())) / count * 1e6:7.1f} {unit}")
    print(f"{'serve_step':34s} {total / count * 1e6:7.1f} {unit}")
    if batch > 1:
        print(f"{'NoAdapt step':34s} {reference / count * 1e6:7.1f} {unit}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
