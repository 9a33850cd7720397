"""ONNX Runtime's CUDA graphs for the device step's fixed-shape calls (``cuda_graphs``, opt-in).

A session opened with ``enable_cuda_graph`` records a call's kernels once (a CUDA graph) and
replays them on later calls: one launch instead of one per kernel, which is most of a call at
small batches (on an H200, 20-47% off the split suffix's call at batch 1, 7-17% at batch 8,
2-7% at batch 32: ``studies/device-step/probe.py``, ``results/h200-2026-12-04/final/``).

A replay reads its inputs from, and writes its outputs to, the addresses bound when it was
recorded. So each recorded call is keyed by its shape: the prefix over N images and the suffix
over R theta rows of those N images (R = r N), a pair per step shape, ORT's ``gpu_graph_id``
(one per pair, at most :data:`MAX_GRAPHS`; a shape beyond them runs unrecorded). The pair's
inputs (the batch, the theta rows), the prefix's activations between the two calls and the
suffix's outputs are CuPy buffers allocated for the pair and bound once: a step copies its
batch and rows into them (device to device) and replays both graphs. Every other call of these
sessions (a served batch, a chunked suffix, a host-step call) runs unrecorded
(``gpu_graph_id`` -1, :func:`unrecorded`), on the sessions' ordinary IOBinding path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

GRAPH_OPTION = "enable_cuda_graph"
MAX_GRAPHS = 8  # recorded step shapes per process (ORT frees a graph only with its session)


def graph_run_options(graph_id: int) -> ort.RunOptions:
    """ORT's run options selecting the recorded graph ``graph_id`` (-1: run unrecorded)."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


def unrecorded() -> ort.RunOptions:
    """Run options for a call of a graph-enabled session that must not be recorded."""
    return graph_run_options(-1)


@dataclass
class _Pair:
    """One recorded step shape: the buffers bound into the prefix's and the suffix's graphs."""

    pixels: Any
    theta: Any
    outputs: dict[str, Any]
    prefix_binding: ort.IOBinding
    suffix_binding: ort.IOBinding
    options: ort.RunOptions


class GraphedSplit:
    """The device step's prefix and suffix calls replayed from CUDA graphs (see the module).

    ``prefix`` / ``suffix``: the split file's sessions, the suffix opened with
    :data:`GRAPH_OPTION`, the prefix too when ``prefix_graphed`` (a prefix ORT cannot record, one
    with nodes off the GPU, runs unrecorded into the same kept buffers); ``boundary``: the
    activations the prefix hands the suffix; ``widths``: each suffix output's shape after its
    first dimension; ``cupy``: the CuPy module."""

    def __init__(self, prefix: ort.InferenceSession, suffix: ort.InferenceSession,
                 boundary: list[str], widths: dict[str, tuple[int, ...]], cupy: Any,
                 prefix_graphed: bool = True) -> None:
        self.prefix = prefix
        self.prefix_graphed = prefix_graphed
        self.suffix = suffix
        self.boundary = boundary
        self.widths = widths
        self.cupy = cupy
        self._pairs: dict[tuple[tuple[int, ...], int, int], _Pair] = {}

    def records(self, pixels: Any, rows: Any) -> bool:
        """Whether a step over ``pixels`` [N, ...] and theta ``rows`` [R, P] runs from graphs
        (its shape recorded already, or room for one more)."""
        return self._key(pixels, rows) in self._pairs or len(self._pairs) < MAX_GRAPHS

    def run(self, pixels: Any, rows: Any, outputs: list[str]) -> list[Any]:
        """``outputs`` [R, ...] (CuPy buffers the next step of this shape overwrites) of the
        split file on CuPy ``pixels`` [N, ...] under CuPy theta ``rows`` [R, P]."""
        key = self._key(pixels, rows)
        pair = self._pairs.get(key) or self._record(key, pixels.shape, rows.shape)
        pair.pixels[...] = pixels
        pair.theta[...] = rows
        self.cupy.cuda.get_current_stream().synchronize()  # the copies end before ORT reads
        self.prefix.run_with_iobinding(pair.prefix_binding,
                                       pair.options if self.prefix_graphed else unrecorded())
        self.suffix.run_with_iobinding(pair.suffix_binding, pair.options)
        return [pair.outputs[name] for name in outputs]

    @staticmethod
    def _key(pixels: Any, rows: Any) -> tuple[tuple[int, ...], int, int]:
        return tuple(pixels.shape), rows.shape[0], rows.shape[1]

    def _record(self, key: tuple[tuple[int, ...], int, int], pixel_shape: tuple[int, ...],
                theta_shape: tuple[int, ...]) -> _Pair:
        """Allocate and bind a new shape's buffers (its graphs are recorded by its first runs)."""
        if len(self._pairs) >= MAX_GRAPHS:
            raise RuntimeError(f"CUDA graphs: more than {MAX_GRAPHS} step shapes")
        cp = self.cupy
        pixels = cp.zeros(pixel_shape, dtype=np.float32)
        theta = cp.zeros(theta_shape, dtype=np.float32)
        hidden = self._boundary_buffers(pixels)
        prefix_binding = self.prefix.io_binding()
        _bind_input(prefix_binding, "pixel_values", pixels)
        for name, buffer in hidden.items():
            _bind_output(prefix_binding, name, buffer)
        suffix_binding = self.suffix.io_binding()
        for name, buffer in hidden.items():
            _bind_input(suffix_binding, name, buffer)
        _bind_input(suffix_binding, "theta", theta)
        outputs = {name: cp.empty((theta_shape[0], *width), dtype=np.float32)
                   for name, width in self.widths.items()}
        for name, buffer in outputs.items():
            _bind_output(suffix_binding, name, buffer)
        pair = _Pair(pixels, theta, outputs, prefix_binding, suffix_binding,
                     graph_run_options(len(self._pairs) + 1))
        self._pairs[key] = pair
        return pair

    def _boundary_buffers(self, pixels: Any) -> dict[str, Any]:
        """CuPy buffers shaped as the prefix's activations on ``pixels`` (one unrecorded call
        reads their shapes and dtypes)."""
        binding = self.prefix.io_binding()
        _bind_input(binding, "pixel_values", pixels)
        for name in self.boundary:
            binding.bind_output(name, "cuda")
        self.prefix.run_with_iobinding(binding, unrecorded())
        values = binding.get_outputs()
        return {name: self.cupy.empty(value.shape(), dtype=_dtype(value.data_type()))
                for name, value in zip(self.boundary, values, strict=True)}


def _dtype(ort_type: str) -> Any:
    """NumPy's dtype of an ORT tensor type string ('tensor(float)', 'tensor(int64)', ...)."""
    names = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(float16)": np.float16, "tensor(bool)": np.bool_, "tensor(double)": np.float64}
    if ort_type not in names:
        raise ValueError(f"CUDA graphs: an activation of type {ort_type} cannot be kept")
    return names[ort_type]


def _bind_input(binding: ort.IOBinding, name: str, array: Any) -> None:
    binding.bind_input(name, "cuda", 0, array.dtype, list(array.shape), array.data.ptr)


def _bind_output(binding: ort.IOBinding, name: str, array: Any) -> None:
    binding.bind_output(name, "cuda", 0, array.dtype, list(array.shape), array.data.ptr)
