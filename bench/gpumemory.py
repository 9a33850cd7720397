"""GPU memory of one process, read from NVML (``nvidia-ml-py``, in the ``[gpu]`` extra).

NVML has no per-process peak, so :class:`GpuMemoryWatch` polls on a thread while the work
runs and keeps the highest reading. A reading is this process's ``usedGpuMemory`` when NVML
lists the process by its PID; inside a container NVML may list host PIDs only, and then the
reading is the device's used memory less what was in use before the process loaded anything
(the bench's memory workers run one at a time, so that difference is the worker's own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_SECONDS = 0.002
MIB = 2**20


@dataclass(frozen=True)
class GpuReading:
    """Bytes in use now, and how they were read: ``process`` or ``device-delta``."""

    bytes_used: int
    source: str


class NvmlReader:
    """Reads this process's GPU memory on device ``index`` (see the module doc). ``nvml``:
    the ``pynvml`` module (a stand-in in tests)."""

    def __init__(self, index: int = 0, nvml: Any = None, pid: int | None = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.pid = os.getpid() if pid is None else pid
        self.baseline = self._device_used()

    def _device_used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def __call__(self) -> GpuReading:
        for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if process.pid == self.pid and process.usedGpuMemory is not None:
                return GpuReading(int(process.usedGpuMemory), "process")
        return GpuReading(max(0, self._device_used() - self.baseline), "device-delta")


class GpuMemoryWatch:
    """Polls ``read`` every ``interval`` seconds between :meth:`start` and :meth:`stop`;
    :attr:`peak` is the highest reading (polls, the first and the last included)."""

    def __init__(self, read: Callable[[], GpuReading], interval: float = POLL_SECONDS) -> None:
        self.read = read
        self.interval = interval
        self.peak = GpuReading(0, "none")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _note(self) -> GpuReading:
        reading = self.read()
        if reading.bytes_used >= self.peak.bytes_used:
            self.peak = reading
        return reading

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._note()

    def start(self) -> GpuReading:
        """Begin polling; returns the reading at the start."""
        first = self._note()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory", daemon=True)
        self._thread.start()
        return first

    def stop(self) -> GpuReading:
        """End polling; returns the peak."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._note()
        return self.peak


def gpu_memory_of(
    load: Callable[[], Callable[[], None]], steps: int, read: Callable[[], GpuReading]
) -> dict[str, float | str]:
    """Run ``load()`` (which returns a step) and ``steps`` steps under a watch; MiB after
    the load (``gpu_load_mb``), the peak over load and steps (``gpu_peak_mb``) and the
    reading's source (``gpu_source``)."""
    watch = GpuMemoryWatch(read)
    watch.start()
    step = load()
    after_load = read()
    for _ in range(steps):
        step()
    peak = watch.stop()
    return {"gpu_load_mb": after_load.bytes_used / MIB, "gpu_peak_mb": peak.bytes_used / MIB,
            "gpu_source": peak.source}
