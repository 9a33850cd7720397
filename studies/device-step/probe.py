"""What the device step builds on, checked on a GPU before it is relied on (one short run):

1. the Philox kernel (:func:`~eva0_edge.runtime.counter_rng.device_rows`) against its NumPy
   reference, normal and uniform streams;
2. ONNX Runtime's IOBinding over CuPy memory (inputs and outputs bound by pointer) against a
   host call;
3. ORT's CUDA graphs (``enable_cuda_graph``) on a model file and on its split suffix: whether a
   session captures, replays the same numbers, and its call time on / off (medians of
   interleaved calls).

    python studies/device-step/probe.py MODEL.onnx [MODEL.onnx ...] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy
import numpy as np
import onnxruntime as ort

from eva0_edge.runtime.counter_rng import NORMAL, UNIFORM, device_rows, draw_rows
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.split import split_files


def check_philox() -> None:
    for stream in (NORMAL, UNIFORM):
        for rows, width, first in ((64, 53_001, 0), (3, 7, 5)):
            ref = draw_rows(7, 123_456_789_012, stream, rows, width, first)
            got = device_rows(7, 123_456_789_012, stream, rows, width, first).get()
            exact = float((ref == got).mean())
            print(f"philox stream {stream} [{rows}x{width}] from row {first}: "
                  f"max |diff| {np.abs(ref - got).max():.3g}, exact {exact:.6f}")


def bound_call(session, feeds, outputs, shapes, run_options=None):
    """One call through IOBinding over CuPy arrays; returns the CuPy outputs."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_input(name, "cuda", 0, value.dtype.type, list(value.shape),
                           value.data.ptr)
    results = {}
    for name in outputs:
        results[name] = cupy.empty(shapes[name], dtype=cupy.float32)
        binding.bind_output(name, "cuda", 0, np.float32, list(shapes[name]),
                            results[name].data.ptr)
    return binding, results


def timed(fn, repeats=30):
    times = []
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def probe_model(path: str, batch: int) -> None:
    md = read_metadata(path)
    x = np.random.default_rng(0).standard_normal((batch, *md.preprocessing.input_size),
                                                 dtype=np.float32)
    theta = np.tile(md.theta0.astype(np.float32), (2 * batch, 1))
    x2 = np.concatenate([x, x])
    plain = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
    want = plain.run(["logits", "features"], {"pixel_values": x2, "theta": theta})
    shapes = {"logits": (2 * batch, md.num_classes), "features": (2 * batch, md.num_features)}
    feeds = {"pixel_values": cupy.asarray(x2), "theta": cupy.asarray(theta)}
    binding, got = bound_call(plain, feeds, ["logits", "features"], shapes)
    plain.run_with_iobinding(binding)
    for name, ref in zip(["logits", "features"], want, strict=True):
        err = float(np.abs(got[name].get() - ref).max() / (np.abs(ref).max() + 1e-12))
        print(f"{path} B={batch}: cupy-bound {name} rel err {err:.2g}")
    sessions = {"file 2B rows": (path, feeds, ["logits", "features"])}
    parts = split_files(path)
    prefix = ort.InferenceSession(str(parts.prefix), providers=["CUDAExecutionProvider"])
    hidden = prefix.run(parts.boundary, {"pixel_values": x})
    suffix_feeds = {name: cupy.asarray(h) for name, h in zip(parts.boundary, hidden, strict=True)}
    suffix_feeds["theta"] = feeds["theta"]
    sessions["suffix 2B rows"] = (str(parts.suffix), suffix_feeds, ["logits", "features"])
    for label, (file, fd, outs) in sessions.items():
        row = {}
        for graph in (False, True):
            try:
                opts = {"enable_cuda_graph": "1"} if graph else {}
                sess = ort.InferenceSession(file, providers=[("CUDAExecutionProvider", opts)])
                binding, out = bound_call(sess, fd, outs, shapes)
                sess.run_with_iobinding(binding)  # capture (graph) / warm-up
                first = out["logits"].get()
                sess.run_with_iobinding(binding)
                same = bool(np.array_equal(first, out["logits"].get()))
                row[graph] = timed(lambda s=sess, b=binding: s.run_with_iobinding(b))
                print(f"  {label} cuda_graph={graph}: {row[graph]:.3f} ms/call, "
                      f"replay equal {same}")
            except Exception as err:  # noqa: BLE001 - the probe reports what ORT refuses
                print(f"  {label} cuda_graph={graph}: FAILED {type(err).__name__}: "
                      f"{str(err)[:300]}")
        if len(row) == 2:
            print(f"  {label}: graph / plain = {row[True] / row[False]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    args = parser.parse_args()
    check_philox()
    for path in args.models:
        for batch in (int(b) for b in args.batches.split(",")):
            probe_model(path, batch)


if __name__ == "__main__":
    main()
