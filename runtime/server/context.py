"""What every route of the server shares: the settings, the model, its worker, the metrics,
readiness, and the request helpers (name check, bounded body read, admin check)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..policy import Policy
from .extension import ServerExtension
from .inference_stats import InferenceStats
from .metrics import ServerMetrics
from .options import ServeOptions
from .protocol import ProtocolError
from .series import AdaptationSeries
from .snapshots import SnapshotStore
from .worker import AdaptationWorker, StepRecord

log = logging.getLogger("eva0_edge.serve")

MODEL_VERSION = "1"


def finite_stats(stats: Any) -> Any:
    """JSON has no NaN: statistics not yet defined (no step seen) or not finite become null,
    at any depth."""
    if isinstance(stats, dict):
        return {k: finite_stats(v) for k, v in stats.items()}
    if isinstance(stats, (list, tuple)):
        return [finite_stats(v) for v in stats]
    if isinstance(stats, float) and not math.isfinite(stats):
        return None
    return stats


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class StepSummary:
    """Counts for the periodic info-level summary line (worker thread only)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()
        self.steps = self.rows = self.requests = 0

    def add(self, record: StepRecord, model: Policy) -> None:
        self.steps += 1
        self.rows += record.rows
        self.requests += record.requests
        if time.monotonic() - self.since >= self.every_s:
            self.emit(model)

    def emit(self, model: Policy) -> None:
        seconds = time.monotonic() - self.since
        stats = model.stats()
        if self.steps:
            log.info(
                "%d requests, %d rows in %d steps over %.0f s (%.1f rows/step); step %d, "
                "%d skipped, drift %.4g, mean entropy %.3f",
                self.requests, self.rows, self.steps, seconds, self.rows / self.steps,
                stats["steps"], stats["skipped_steps"], stats["drift"], stats["mean_entropy"],
            )
        self.reset()


async def read_body(request: Request, limit: int, timeout_s: float) -> bytearray:
    """The request body, at most ``limit`` bytes (413 beyond, before or while it arrives), within
    ``timeout_s`` seconds (408); one buffer, sized up front when the length is declared."""
    declared = request.headers.get("content-length")
    expected = int(declared) if declared is not None and declared.isdigit() else 0
    if expected > limit:
        raise ProtocolError(f"request body of {declared} bytes exceeds the limit of {limit}", 413)

    async def read() -> bytearray:
        body = bytearray(expected)
        size = 0
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                raise ProtocolError(f"request body exceeds the limit of {limit} bytes", 413)
            if size + len(chunk) <= expected:
                body[size : size + len(chunk)] = chunk
            else:
                del body[size:]
                body += chunk
            size += len(chunk)
        del body[size:]
        return body

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ProtocolError(f"request body did not arrive within {timeout_s:g} s", 408) from None


def _host_name(value: str) -> str:
    """The host of a ``Host`` header or of an origin's authority, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_local_name(host: str, bound: str) -> bool:
    """A loopback name or address, or the address the server was bound to."""
    if host in ("localhost", bound.lower()) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_check(request: Request, options: ServeOptions, body: str | None = None) -> None:
    """401 without the right bearer token when one is set; 403 off loopback without one.

    Loopback alone is no trust boundary: a web page can make the browser send a simple POST to
    127.0.0.1, and DNS rebinding gives a page's own name a loopback address. So without a
    token the ``Host`` must be a loopback name or address (or the bound host); with or
    without one, an ``Origin`` (browsers send it on cross-site requests) must be too; and a
    route that takes a body (``body``: its media type) refuses any other Content-Type
    (text/plain, forms: what a page can send without a preflight)."""
    origin = request.headers.get("origin")
    if origin is not None and not _is_local_name(
        _host_name(origin.partition("://")[2] or origin), options.host
    ):
        raise ProtocolError(f"admin endpoint: requests from origin {origin[:100]!r} are refused",
                            403)
    if body is not None:
        given = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if given != body:
            raise ProtocolError(f"admin endpoint: the body must be sent as Content-Type {body}, "
                                f"got {given[:100] or 'none'!r}", 415)
    if options.admin_token is None:
        if not options.loopback:
            raise ProtocolError(
                "admin endpoints are disabled on a non-loopback bind without an admin token "
                "(--admin-token or EVA0_ADMIN_TOKEN)", 403,
            )
        host = request.headers.get("host", "")
        if not _is_local_name(_host_name(host), options.host):
            raise ProtocolError(
                f"admin endpoint: Host {host[:100]!r} is not a loopback name or address (without "
                "an admin token, admin requests must name this machine)", 403,
            )
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), options.admin_token.encode()
    ):
        raise ProtocolError("admin endpoint: missing or wrong bearer token", 401)


@dataclass
class ServerContext:
    """The served model and what the routes need around it (the worker owns the state)."""

    model: Policy
    options: ServeOptions
    worker: AdaptationWorker
    metrics: ServerMetrics
    snapshots: SnapshotStore | None
    ready: asyncio.Event
    extension: ServerExtension | None = None
    non_finite_rows: int = 0
    inference: InferenceStats = field(default_factory=InferenceStats)
    series: AdaptationSeries = field(default_factory=AdaptationSeries)

    def count_non_finite(self, rows: int) -> None:
        """Rows of the model's output that were not finite (statistics and metrics)."""
        self.non_finite_rows += rows
        self.metrics.non_finite_rows.inc(rows)

    @property
    def body_limit(self) -> int:
        """The largest request body accepted, in bytes."""
        return int(self.options.max_body_mb * 2**20)

    @property
    def max_pixels(self) -> int:
        """Decoded pixels allowed per ``images`` request."""
        return int(self.options.max_pixels_mp * 1e6)

    def check_name(self, name: str, version: str = MODEL_VERSION) -> None:
        """404 for another model's name or an unknown version (a route's dependency:
        ``Depends(ctx.check_name)`` reads both from its path, or ``version`` from the query)."""
        if name != self.options.name:
            raise ProtocolError(
                f"unknown model {name!r}; this server serves {self.options.name!r}", 404
            )
        if version != MODEL_VERSION:
            raise ProtocolError(
                f"unknown version {version!r} of {name!r}; versions: [{MODEL_VERSION!r}]", 404
            )

    def admin(self, body: str | None = None) -> Callable[[Request], None]:
        """The admin check of a route as a dependency (``Depends(ctx.admin(...))``): see
        :func:`admin_check`; ``body``: the media type of the body it takes, if any."""

        def check(request: Request) -> None:
            admin_check(request, self.options, body)

        return check

    async def read_body(self, request: Request, limit: int | None = None) -> bytearray:
        """The body, at most ``limit`` bytes (default: the server's body limit)."""
        return await read_body(request, self.body_limit if limit is None else limit,
                               self.options.body_timeout_s)

    async def on_worker(self, operation) -> Any:
        """``operation(model)`` on the worker thread, between steps."""
        return await asyncio.wrap_future(self.worker.call(operation))
