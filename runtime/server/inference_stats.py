"""The inference counts Triton's statistics extension reports (``GET /v2/models/{name}/stats``),
kept by the inference route: requests that succeeded and failed with their summed durations,
inferred rows, the time of the last inference, and where a successful request's time went
(:class:`RequestTimes`). Read under the lock, as one snapshot."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields


@dataclass
class RequestTimes:
    """Where one request's time went, in seconds, by the extension's parts: its body decoded
    and checked (``compute_input``), waiting in the worker's queue until its batch began
    (``queue``), the batch's model step, shared by every request of the batch (``compute_infer``,
    as Triton counts a batch's execution for each of its requests), its outputs encoded
    (``compute_output``). The route fills the first and last, the worker the middle two before
    it answers."""

    compute_input: float = 0.0
    queue: float = 0.0
    compute_infer: float = 0.0
    compute_output: float = 0.0


PARTS = tuple(f.name for f in fields(RequestTimes))


@dataclass
class InferenceStats:
    """Counts since the server started (durations in nanoseconds, as the extension has them)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    inference_count: int = 0  # rows inferred by successful requests
    last_inference_ms: int = 0  # milliseconds since the epoch
    # each part's summed time over the successful requests (their count is success_count)
    part_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, ok: bool, seconds: float, rows: int, times: RequestTimes) -> None:
        """One answered request of ``rows`` rows that took ``seconds``, its parts' ``times``
        (counted when it succeeded)."""
        with self._lock:
            if ok:
                self.success_count += 1
                self.success_ns += int(seconds * 1e9)
                self.inference_count += rows
                self.last_inference_ms = int(time.time() * 1000)
                for name in PARTS:
                    self.part_ns[name] += int(getattr(times, name) * 1e9)
            else:
                self.fail_count += 1
                self.fail_ns += int(seconds * 1e9)

    def model_stats(self, name: str, version: str, executions: int) -> dict:
        """The extension's ``model_stats`` entry of this model; ``executions``: the batches
        the model ran (the worker's count). Every successful request counts once in each part
        (``queue``, ``compute_*``): perf_analyzer finds the model's version by the queue
        count that grew during its measurement."""
        with self._lock:
            zero = {"count": 0, "ns": 0}
            parts = {part: {"count": self.success_count, "ns": self.part_ns[part]}
                     for part in PARTS}
            return {
                "name": name, "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": executions,
                "inference_stats": {
                    "success": {"count": self.success_count, "ns": self.success_ns},
                    "fail": {"count": self.fail_count, "ns": self.fail_ns},
                    **parts, "cache_hit": dict(zero), "cache_miss": dict(zero),
                },
                "batch_stats": [],
            }
