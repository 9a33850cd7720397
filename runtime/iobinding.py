"""ONNX Runtime calls through IOBinding, with output buffers allocated once and reused."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from .arrays import namespace

# Row counts whose buffers are kept per output and per device input (a step and a served
# prediction alternate between 2B and B rows; FOA adds 28B; a server's batches vary in size)
KEPT_ROW_COUNTS = 4


class BoundRunner:
    """Runs ``session`` through one reused ``IOBinding``.

    Inputs are bound where they are: host arrays directly on the CPU provider; on CUDA they are
    copied into device buffers kept per input name and shape (the last ``KEPT_ROW_COUNTS``
    shapes: one host-to-device copy per call, no allocation, also when a budgeted step's 2B rows
    and a served batch's B rows alternate). Outputs are written into host float32 buffers kept
    per (output, row count), so a call allocates no output arrays.

    The arrays returned are those buffers: the next call with the same row count overwrites
    them. Copy what must outlive the call.

    Outputs a later call consumes (split sessions' prefix activations) can stay where the
    session computed them: they come back as ``OrtValue`` s and are bound as they are, so on
    CUDA they never cross to the host.

    The device step (:mod:`.device_step`) binds CuPy arrays: inputs by their device pointer,
    outputs (``device_outputs``) into CuPy buffers kept per (output, row count) like the host
    ones. ORT's call synchronises its stream before it returns; CuPy's work is waited for
    before the call (:meth:`run`), so each side reads what the other wrote."""

    def __init__(self, session: ort.InferenceSession, device: str) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"IOBinding device must be 'cpu' or 'cuda', got {device!r}")
        self.session = session
        self.device = device
        self.binding = session.io_binding()
        self.output_widths = {
            output.name: tuple(output.shape[1:]) for output in session.get_outputs()
        }
        self._outputs: dict[str, OrderedDict[int, tuple[np.ndarray, ort.OrtValue]]] = {}
        self._device_outputs: dict[str, OrderedDict[int, Any]] = {}
        self._device_inputs: dict[str, OrderedDict[tuple[int, ...], ort.OrtValue]] = {}

    def run(
        self, feeds: Mapping[str, Any], outputs: list[str], rows: int,
        on_device: Collection[str] = (), device_outputs: bool = False,
    ) -> list:
        """Run with ``feeds`` (C-contiguous float32 host arrays, OrtValues already on the
        session's device, or C-contiguous float32 CuPy arrays) and return ``outputs`` in
        order: each [rows, *width] float32 host array (CuPy array with ``device_outputs``),
        but those named in ``on_device``: OrtValues left on the device (valid until the next
        call)."""
        binding = self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        device_feeds = False
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            elif namespace(value) is not np:
                device_feeds = True
                binding.bind_input(name, "cuda", 0, np.float32, list(value.shape),
                                   value.data.ptr)
            elif self.device == "cpu":
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, self._device_input(name, value))
        results: list = []
        for name in outputs:
            if name in on_device:
                binding.bind_output(name, self.device)
                results.append(None)
            elif device_outputs:
                device_feeds = True
                buffer = self._device_output(name, rows)
                binding.bind_output(name, "cuda", 0, np.float32, list(buffer.shape),
                                    buffer.data.ptr)
                results.append(buffer)
            else:
                buffer, value = self._output(name, rows)
                binding.bind_ortvalue_output(name, value)
                results.append(buffer)
        if device_feeds:  # CuPy's kernels (the null stream) end before ORT's stream reads
            sys.modules["cupy"].cuda.get_current_stream().synchronize()
        self.session.run_with_iobinding(binding)
        if on_device:
            values = binding.get_outputs()
            results = [values[i] if r is None else r for i, r in enumerate(results)]
        return results

    def _device_input(self, name: str, array: np.ndarray) -> ort.OrtValue:
        kept = self._device_inputs.setdefault(name, OrderedDict())
        value = kept.get(array.shape)
        if value is None:
            value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, np.float32, "cuda", 0)
            kept[array.shape] = value
            if len(kept) > KEPT_ROW_COUNTS:
                kept.popitem(last=False)
        kept.move_to_end(array.shape)
        value.update_inplace(array)
        return value

    def _device_output(self, name: str, rows: int) -> Any:
        kept = self._device_outputs.setdefault(name, OrderedDict())
        if rows in kept:
            kept.move_to_end(rows)
            return kept[rows]
        kept[rows] = sys.modules["cupy"].empty((rows, *self._width(name)), dtype=np.float32)
        if len(kept) > KEPT_ROW_COUNTS:
            kept.popitem(last=False)
        return kept[rows]

    def _width(self, name: str) -> tuple[int, ...]:
        width = self.output_widths[name]
        if not all(isinstance(d, int) for d in width):
            raise ValueError(
                f"output {name!r} has shape [N, {', '.join(map(str, width))}]: a kept buffer "
                "needs every dimension but the first to be static"
            )
        return width

    def _output(self, name: str, rows: int) -> tuple[np.ndarray, ort.OrtValue]:
        kept = self._outputs.setdefault(name, OrderedDict())
        if rows in kept:
            kept.move_to_end(rows)
            return kept[rows]
        buffer = np.empty((rows, *self._width(name)), dtype=np.float32)
        kept[rows] = (buffer, ort.OrtValue.ortvalue_from_numpy(buffer))
        if len(kept) > KEPT_ROW_COUNTS:
            kept.popitem(last=False)
        return kept[rows]
