"""What a component around one served model (the fleet's replica sync) hooks into the server
with: started after the worker, stopped before it, its statistics under its own key in
``adaptation/statistics`` and its gauges in ``/metrics``. The plain server has none."""

from __future__ import annotations

from typing import Any, Protocol

from .worker import AdaptationWorker


class ServerExtension(Protocol):
    """``name``: the key of :meth:`statistics` in the statistics answer."""

    name: str

    def start(self, worker: AdaptationWorker) -> None:
        """Called once the worker runs (the extension may ``worker.call`` from now on)."""

    def stop(self) -> None:
        """Called before the worker stops."""

    def state_replaced(self, model: Any) -> None:
        """Called on the worker thread after an admin replaced the model's state (reset, PUT
        state)."""

    def statistics(self) -> dict[str, Any]:
        """JSON-serialisable counters."""

    def gauges(self) -> list[tuple[str, str, float]]:
        """Prometheus gauges: (metric name, help, value)."""
