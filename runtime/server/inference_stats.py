"""The inference counts Triton's statistics extension reports (``GET /v2/models/{name}/stats``),
kept by the inference route: requests that succeeded and failed with their summed durations,
inferred rows, and the time of the last inference. Read under the lock, as one snapshot."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class InferenceStats:
    """Counts since the server started (durations in nanoseconds, as the extension has them)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    inference_count: int = 0  # rows inferred by successful requests
    last_inference_ms: int = 0  # milliseconds since the epoch
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, ok: bool, seconds: float, rows: int) -> None:
        """One answered request of ``rows`` rows that took ``seconds``."""
        with self._lock:
            if ok:
                self.success_count += 1
                self.success_ns += int(seconds * 1e9)
                self.inference_count += rows
                self.last_inference_ms = int(time.time() * 1000)
            else:
                self.fail_count += 1
                self.fail_ns += int(seconds * 1e9)

    def model_stats(self, name: str, version: str, executions: int) -> dict:
        """The extension's ``model_stats`` entry of this model; ``executions``: the batches
        the model ran (the worker's count)."""
        with self._lock:
            zero = {"count": 0, "ns": 0}
            return {
                "name": name, "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": executions,
                "inference_stats": {
                    "success": {"count": self.success_count, "ns": self.success_ns},
                    "fail": {"count": self.fail_count, "ns": self.fail_ns},
                    "queue": dict(zero), "compute_input": dict(zero),
                    "compute_infer": dict(zero), "compute_output": dict(zero),
                    "cache_hit": dict(zero), "cache_miss": dict(zero),
                },
                "batch_stats": [],
            }
