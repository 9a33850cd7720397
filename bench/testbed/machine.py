"""The machine a benchmark ran on: CPU, cores, GPU, library versions and the load average."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
from typing import Any

import numpy as np
import onnxruntime as ort


def gpu_name() -> str | None:
    """The first GPU nvidia-smi lists, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def environment() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu_name(), "onnxruntime": ort.__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def process_peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM) in MB. Not ``ru_maxrss``: Linux carries that across
    fork + exec, so a worker would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
