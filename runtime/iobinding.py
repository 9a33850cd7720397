"""ONNX Runtime calls through IOBinding, with output buffers allocated once and reused."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnxruntime as ort

# Row counts whose output buffers are kept per output (a step and a prediction alternate
# between 2B and B rows; FOA adds 28B).
KEPT_ROW_COUNTS = 4


class BoundRunner:
    """Runs ``session`` through one reused ``IOBinding``.

    Inputs are bound where they are: host arrays directly on the CPU provider; on CUDA they are
    copied into device buffers kept per input name and shape (one host-to-device copy per call,
    no allocation). Outputs are written into host float32 buffers kept per (output, row count),
    so a call allocates no output arrays.

    The arrays returned are those buffers: the next call with the same row count overwrites
    them. Copy what must outlive the call."""

    def __init__(self, session: ort.InferenceSession, device: str) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"IOBinding device must be 'cpu' or 'cuda', got {device!r}")
        self.session = session
        self.device = device
        self.binding = session.io_binding()
        self.output_widths: dict[str, tuple[int, ...]] = {}
        for output in session.get_outputs():
            width = tuple(output.shape[1:])
            if not all(isinstance(d, int) for d in width):
                raise ValueError(
                    f"output {output.name!r} has shape {output.shape}: IOBinding needs every "
                    "dimension but the first to be static"
                )
            self.output_widths[output.name] = width
        self._outputs: dict[str, OrderedDict[int, tuple[np.ndarray, ort.OrtValue]]] = {}
        self._device_inputs: dict[str, ort.OrtValue] = {}

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str], rows: int) -> list[np.ndarray]:
        """Run with ``feeds`` (C-contiguous float32 host arrays) and return ``outputs``, each
        [rows, *width] float32, in order."""
        binding = self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name, array in feeds.items():
            if self.device == "cpu":
                binding.bind_cpu_input(name, array)
            else:
                binding.bind_ortvalue_input(name, self._device_input(name, array))
        results = []
        for name in outputs:
            buffer, value = self._output(name, rows)
            binding.bind_ortvalue_output(name, value)
            results.append(buffer)
        self.session.run_with_iobinding(binding)
        return results

    def _device_input(self, name: str, array: np.ndarray) -> ort.OrtValue:
        value = self._device_inputs.get(name)
        if value is None or tuple(value.shape()) != array.shape:
            value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, np.float32, "cuda", 0)
            self._device_inputs[name] = value
        value.update_inplace(array)
        return value

    def _output(self, name: str, rows: int) -> tuple[np.ndarray, ort.OrtValue]:
        kept = self._outputs.setdefault(name, OrderedDict())
        if rows in kept:
            kept.move_to_end(rows)
            return kept[rows]
        buffer = np.empty((rows, *self.output_widths[name]), dtype=np.float32)
        kept[rows] = (buffer, ort.OrtValue.ortvalue_from_numpy(buffer))
        if len(kept) > KEPT_ROW_COUNTS:
            kept.popitem(last=False)
        return kept[rows]
