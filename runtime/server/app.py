"""The HTTP application: Open Inference Protocol endpoints, the adaptation extension and
Prometheus metrics, over one :class:`AdaptationWorker`.

Endpoints (``{name}`` is the served model's name):

* ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2`` (server metadata)
* ``GET /v2/models/{name}`` (model metadata), ``GET /v2/models/{name}/ready``
* ``POST /v2/models/{name}[/versions/1]/infer``
* adaptation extension: ``GET /v2/models/{name}/adaptation/statistics``,
  ``POST .../adaptation/reset``, ``POST .../adaptation/freeze`` (``{"frozen": bool}``),
  ``GET .../adaptation/state`` (npz bytes), ``PUT .../adaptation/state`` (npz bytes, verified
  before it replaces anything)
* ``GET /metrics``

Errors answer with the protocol's ``{"error": "..."}`` and a 4xx status; nothing that fails
validation reaches the worker, so bad input never touches the adaptation state.

Admin endpoints (reset, freeze, PUT state) need ``Authorization: Bearer <token>`` when a token
is set (``--admin-token`` or ``EVA0_ADMIN_TOKEN``); without a token they are open on a loopback
bind only and answer 403 elsewhere. Inference and the read-only endpoints stay open. No interactive
docs or OpenAPI schema are served.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from eva0_edge import __version__

from ..engine import AdaptiveModel
from ..session import InputError
from ..state import StateError
from .metrics import ServerMetrics
from .protocol import HEADER_LENGTH, ProtocolError, encode_infer_response, parse_infer_request
from .snapshots import SnapshotStore
from .tensors import model_input, model_metadata, model_outputs, plan_outputs
from .worker import AdaptationWorker, StepRecord

log = logging.getLogger("eva0_edge.serve")

MODEL_VERSION = "1"


@dataclass
class ServeOptions:
    """Server settings. ``max_delay_ms``: how long the oldest queued request may wait for others to
    join its step; ``adaptive_delay``: wait only while announced requests are still being
    decoded (see :mod:`.worker`), else up to ``max_delay_ms`` always; ``snapshot_every``: steps
    between snapshots; ``max_body_mb``: the largest request body accepted (MiB);
    ``summary_every_s``: seconds between info-level summaries; ``max_pixels_mp``: decoded
    megapixels per ``images`` request; ``admin_token``: the bearer token of the admin endpoints;
    ``loopback``: the server binds a loopback address only (admin endpoints are open there
    without a token); ``body_timeout_s``: the longest a request body may take to arrive;
    ``header_timeout_s``: the longest a request's headers may take, from the connection's
    opening or the previous response (then 408 and the connection is closed)."""

    name: str
    max_batch: int = 64
    max_delay_ms: float = 10.0
    adaptive_delay: bool = True
    state_dir: str | None = None
    snapshot_every: int = 100
    keep_snapshots: int = 3
    max_body_mb: float = 64.0
    summary_every_s: float = 30.0
    max_pixels_mp: float = 32.0
    admin_token: str | None = None
    loopback: bool = True
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0


def _finite(stats: dict) -> dict:
    """JSON has no NaN: statistics not yet defined (no step seen) become null."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in stats.items()
    }


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _Summary:
    """Counts for the periodic info-level summary line (worker thread only)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()
        self.steps = self.rows = self.requests = 0

    def add(self, record: StepRecord, model: AdaptiveModel) -> None:
        self.steps += 1
        self.rows += record.rows
        self.requests += record.requests
        if time.monotonic() - self.since >= self.every_s:
            self.emit(model)

    def emit(self, model: AdaptiveModel) -> None:
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


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"request body of {declared} bytes exceeds the limit of {limit}", 413)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"request body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ProtocolError(f"request body did not arrive within {timeout_s:g} s", 408) from None


def _admin_check(request: Request, options: ServeOptions) -> None:
    """401 without the right bearer token when one is set; 403 off loopback without one."""
    if options.admin_token is None:
        if not options.loopback:
            raise ProtocolError(
                "admin endpoints are disabled on a non-loopback bind without an admin token "
                "(--admin-token or EVA0_ADMIN_TOKEN)", 403,
            )
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), options.admin_token.encode()
    ):
        raise ProtocolError("admin endpoint: missing or wrong bearer token", 401)


def create_app(model: AdaptiveModel, options: ServeOptions) -> FastAPI:
    """The application around ``model``; the worker starts and stops with the app's lifespan
    (restoring the newest good snapshot from ``options.state_dir`` first)."""
    metrics = ServerMetrics(options.max_batch)
    summary = _Summary(options.summary_every_s)
    snapshots = (
        SnapshotStore(options.state_dir, options.keep_snapshots) if options.state_dir else None
    )

    def on_step(record: StepRecord) -> None:
        metrics.record_step(
            record, float(np.linalg.norm(model.state.theta - model.metadata.theta0)),
            model.state,
        )
        summary.add(record, model)

    worker = AdaptationWorker(
        model, options.max_batch, options.max_delay_ms / 1000.0, snapshots,
        options.snapshot_every, on_step, options.adaptive_delay,
    )
    limit = int(options.max_body_mb * 2**20)
    max_pixels = int(options.max_pixels_mp * 1e6)
    ready = asyncio.Event()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if snapshots is not None:
            restored = snapshots.restore_latest(model)
            if restored:
                log.info("resumed from %s at step %d", restored, model.state.step)
        worker.start()
        ready.set()
        log.info(
            "serving %s (%s, %s) max batch %d, max delay %.1f ms", options.name,
            model.metadata.architecture, model.method, options.max_batch, options.max_delay_ms,
        )
        try:
            yield
        finally:
            ready.clear()
            await run_in_threadpool(worker.stop)
            summary.emit(model)
            log.info("stopped at step %d", model.state.step)

    app = FastAPI(
        title="eva0-edge", version=__version__, lifespan=lifespan,
        docs_url=None, redoc_url=None, openapi_url=None,
    )

    def check_name(name: str, version: str = MODEL_VERSION) -> None:
        if name != options.name:
            raise ProtocolError(f"unknown model {name!r}; this server serves {options.name!r}", 404)
        if version != MODEL_VERSION:
            raise ProtocolError(
                f"unknown version {version!r} of {name!r}; versions: [{MODEL_VERSION!r}]", 404
            )

    @app.exception_handler(ProtocolError)
    async def protocol_error(_: Request, err: ProtocolError) -> JSONResponse:
        return _error(str(err), err.status)

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def server_ready() -> Response:
        return Response(status_code=200 if ready.is_set() and worker.alive else 503)

    @app.get("/v2")
    async def server_metadata() -> dict:
        return {
            "name": "eva0-edge", "version": __version__,
            "extensions": ["binary_tensor_data", "eva0_adaptation"],
        }

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str = MODEL_VERSION) -> dict:
        check_name(name, version)
        return model_metadata(options.name, MODEL_VERSION, model.metadata)

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str = MODEL_VERSION) -> Response:
        check_name(name, version)
        return Response(status_code=200 if ready.is_set() else 503)

    def prepare(body: bytes, header_length: str | None):
        request = parse_infer_request(body, header_length)
        plans = plan_outputs(request.outputs, request.binary_output, model.metadata.num_classes)
        x = model_input(request, model.metadata, options.max_batch, max_pixels)
        try:
            x = model.session.check_input(x)
        except InputError as err:
            raise ProtocolError(str(err)) from None
        return request, plans, x

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = MODEL_VERSION) -> Response:
        start = time.perf_counter()
        status = 200
        announced = False
        try:
            check_name(name, version)
            if not ready.is_set() or not worker.alive:
                raise ProtocolError("server is not ready", 503)
            worker.announce()  # a forming batch may wait for this request while it decodes
            announced = True
            body = await _read_body(request, limit, options.body_timeout_s)
            parsed, plans, x = await run_in_threadpool(
                prepare, body, request.headers.get(HEADER_LENGTH)
            )
            future = worker.submit(x, announced=True)
            announced = False
            logits = await asyncio.wrap_future(future)
            outputs = model_outputs(logits, plans, model.metadata.labels)
            content, headers = encode_infer_response(
                options.name, MODEL_VERSION, parsed.id, outputs
            )
            return Response(content, headers=headers)
        except ProtocolError as err:
            status = err.status
            return _error(str(err), status)
        except Exception as err:
            status = 500
            log.exception("inference failed")
            return _error(f"inference failed: {err}", status)
        finally:
            if announced:
                worker.withdraw()
            elapsed = time.perf_counter() - start
            metrics.requests.labels(str(status)).inc()
            if status == 200:
                metrics.latency.observe(elapsed)
            log.debug("infer %s %d %.1f ms", name, status, 1000 * elapsed)

    async def on_worker(operation):
        return await asyncio.wrap_future(worker.call(operation))

    @app.get("/v2/models/{name}/adaptation/statistics")
    async def statistics(name: str) -> dict:
        check_name(name)
        stats = await on_worker(lambda m: m.stats())
        stats["snapshots_written"] = snapshots.written if snapshots else 0
        return _finite(stats)

    @app.post("/v2/models/{name}/adaptation/reset")
    async def reset(name: str, request: Request) -> dict:
        check_name(name)
        _admin_check(request, options)

        def do_reset(m: AdaptiveModel) -> dict:
            m.reset()
            return {**_finite(m.stats()), "snapshot_written": worker.snapshot_now()}

        return await on_worker(do_reset)

    @app.post("/v2/models/{name}/adaptation/freeze")
    async def freeze(name: str, request: Request) -> dict:
        """Body ``{"frozen": true|false}``: predict without adapting, or resume."""
        check_name(name)
        _admin_check(request, options)
        try:
            frozen = (await request.json())["frozen"]
        except (ValueError, KeyError, TypeError):
            frozen = None
        if not isinstance(frozen, bool):
            raise ProtocolError('freeze needs a JSON body {"frozen": true} or {"frozen": false}')

        def do_freeze(m: AdaptiveModel) -> dict:
            m.freeze(frozen)
            return {**_finite(m.stats()), "snapshot_written": worker.snapshot_now()}

        return await on_worker(do_freeze)

    @app.get("/v2/models/{name}/adaptation/state")
    async def get_state(name: str) -> Response:
        check_name(name)
        data = await on_worker(lambda m: m.state_bytes())
        return Response(data, media_type="application/octet-stream")

    @app.put("/v2/models/{name}/adaptation/state")
    async def put_state(name: str, request: Request) -> Response:
        check_name(name)
        _admin_check(request, options)
        body = await _read_body(request, limit, options.body_timeout_s)
        try:  # decoded and validated off the worker thread: inference goes on meanwhile
            state = await run_in_threadpool(model.parse_state_bytes, body)
        except StateError as err:
            return _error(f"state refused: {err}", 400)

        def install(m: AdaptiveModel) -> dict:
            m.install_state(state)
            return {**_finite(m.stats()), "snapshot_written": worker.snapshot_now()}

        return JSONResponse(await on_worker(install))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app
