"""Calibration activations for the scale search, captured in one pass with bounded memory.

One ORT session exposes every tensor the search reads as a graph output and runs the float
model (theta = theta0) on CAPTURE_IMAGES calibration images at a time; each chunk's tensors are
reduced to what the search scores on before the next chunk runs, so memory holds one chunk's
activations plus the samples, never the calibration set's activations:

* ``rows``: rows of a linear layer's X (tokens, im2col windows), MAX_ROWS in all, spread over
  the chunks in proportion to their images;
* ``images``: the first ATTENTION_IMAGES images of an attention operand (all heads and rows);
* ``values``: MAX_ROWS^2 values of a layer output, drawn with replacement.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from .search import ATTENTION_IMAGES, MAX_ROWS, layer_rows

CAPTURE_IMAGES = 4  # calibration images per ORT run


@dataclass(frozen=True)
class Sample:
    """What to keep of graph tensor ``tensor``: ``kind`` 'rows' (of layer ``node``'s X, whose
    weight has shape ``weight_shape``), 'images' or 'values'."""

    tensor: str
    kind: str
    node: onnx.NodeProto | None = None
    weight_shape: tuple[int, ...] = ()


def _reduce(sample: Sample, value: np.ndarray, share: float, taken: int,
            rng: np.random.Generator) -> np.ndarray | None:
    if sample.kind == "rows":
        return layer_rows(sample.node, value, sample.weight_shape,
                          math.ceil(MAX_ROWS * share), rng)
    if sample.kind == "images":
        return value[:ATTENTION_IMAGES - taken] if taken < ATTENTION_IMAGES else None
    if sample.kind == "values":
        flat = value.reshape(-1)
        return flat[rng.integers(0, flat.size, math.ceil(MAX_ROWS * MAX_ROWS * share))]
    raise ValueError(f"unknown sample kind {sample.kind!r}")


def capture(
    model: onnx.ModelProto,
    samples: dict[Hashable, Sample],
    x: np.ndarray,
    theta0: np.ndarray,
    rng: np.random.Generator,
) -> dict[Hashable, np.ndarray]:
    """{key: sampled values} of every ``samples`` entry on calibration images ``x``
    [N, C, H, W] (normalised float32), run with theta = ``theta0`` [P]."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    inputs = {i.name for i in probe.graph.input}
    existing = {o.name for o in probe.graph.output}
    names = sorted({s.tensor for s in samples.values()} - inputs)
    for name in sorted(set(names) - existing):
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False  # the chunks' outputs are freed, not pooled
    options.add_session_config_entry("session.disable_prepacking", "1")  # no 2nd weight copy
    serialized = probe.SerializeToString()
    del probe  # a ViT-B graph is 347 MB: hold one copy besides the caller's while loading
    session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
    del serialized
    parts: dict[Hashable, list[np.ndarray]] = {key: [] for key in samples}
    taken = 0
    for start in range(0, len(x), CAPTURE_IMAGES):
        chunk = x[start:start + CAPTURE_IMAGES]
        feeds = {"pixel_values": chunk, "theta": np.repeat(theta0[None], len(chunk), axis=0)}
        values = dict(zip(names, session.run(names, feeds), strict=True))
        values.update({name: feeds[name] for name in inputs if name in feeds})
        for key, sample in samples.items():
            kept = _reduce(sample, values[sample.tensor], len(chunk) / len(x), taken, rng)
            if kept is not None:
                parts[key].append(kept)
        taken += len(chunk)
        del values
    return {key: np.concatenate(chunks) for key, chunks in parts.items()}
