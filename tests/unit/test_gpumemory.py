"""The bench's GPU memory reading, behind a stand-in for NVML: the process's own bytes when
NVML lists its PID, the device's growth otherwise; a peak caught between two readings; the
table and the ratios built from them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from eva0_edge.bench.gpumemory import GpuMemoryWatch, GpuReading, NvmlReader, gpu_memory_of

MIB = 2**20


class FakeNvml:
    """The few pynvml calls the reader makes, over a settable device state."""

    def __init__(self, used: int, processes: dict[int, int]) -> None:
        self.used, self.processes, self.initialised = used, processes, False

    def nvmlInit(self):  # noqa: N802 (pynvml's names)
        self.initialised = True

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        assert self.initialised
        return ("gpu", index)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return SimpleNamespace(used=self.used, total=80 * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in self.processes.items()]


def test_reader_takes_the_process_line_when_nvml_lists_it():
    nvml = FakeNvml(used=5000 * MIB, processes={41: 900 * MIB, 42: 300 * MIB})
    reader = NvmlReader(nvml=nvml, pid=42)
    assert reader() == GpuReading(300 * MIB, "process")


def test_reader_falls_back_to_the_devices_growth_since_it_started():
    """In a container NVML lists host PIDs: the reading is device use less the baseline."""
    nvml = FakeNvml(used=1000 * MIB, processes={7: 1 * MIB})
    reader = NvmlReader(nvml=nvml, pid=42)
    nvml.used = 1750 * MIB
    assert reader() == GpuReading(750 * MIB, "device-delta")


def test_watch_catches_a_peak_between_the_readings_at_the_ends():
    level = {"bytes": 100}

    def spike():
        level["bytes"] = 900
        time.sleep(0.05)
        level["bytes"] = 200

    def read():
        return GpuReading(level["bytes"], "process")

    result = gpu_memory_of(lambda: spike, steps=2, read=read)
    assert result["gpu_peak_mb"] == pytest.approx(900 / MIB)
    assert result["gpu_load_mb"] == pytest.approx(100 / MIB)  # read before the first step
    watch = GpuMemoryWatch(read)
    watch.start()
    assert watch.stop().bytes_used == 200  # no spike while watched: the level itself
