"""Arrays on the host (NumPy) or on a CUDA device (CuPy, optional: the ``[gpu]`` extra).

The runtime imports CuPy only where a CUDA session asks for device arrays
(:func:`cupy_or_none`); code written once for both reads the namespace off its input
(:func:`namespace`), so a host array runs the very NumPy calls it always ran.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np


def namespace(array: Any) -> ModuleType:
    """The array module of ``array``: CuPy for a CuPy array, NumPy for anything else."""
    if type(array).__module__.startswith("cupy"):
        return sys.modules["cupy"]
    return np


def to_host(array: Any) -> np.ndarray:
    """``array`` as a NumPy array (a device array is copied back; a host one is returned)."""
    return np.asarray(array) if namespace(array) is np else array.get()


def cupy_or_none() -> ModuleType | None:
    """CuPy with a usable CUDA device, or None (not installed, no device, or a CUDA library it
    cannot load)."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # noqa: BLE001 - CuPy raises its own CUDA errors when there is no driver
        return None
    return cupy
