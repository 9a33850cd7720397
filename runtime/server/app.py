"""The HTTP application: Open Inference Protocol endpoints (:mod:`.routes_oip`), the adaptation
extension and Prometheus metrics (:mod:`.routes_adaptation`), over one :class:`AdaptationWorker`
and the :class:`~.context.ServerContext` they share.

Endpoints (``{name}`` is the served model's name):

* ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2`` (server metadata)
* ``GET /v2/models/{name}`` (model metadata), ``GET /v2/models/{name}/ready``
* ``POST /v2/models/{name}[/versions/1]/infer``
* adaptation extension: ``GET /v2/models/{name}/adaptation/statistics``,
  ``POST .../adaptation/reset``, ``POST .../adaptation/freeze`` (``{"frozen": bool}``),
  ``GET .../adaptation/state`` (npz bytes), ``PUT .../adaptation/state`` (npz bytes, verified
  before it replaces anything)
* ``GET /metrics``
* the operator's view (:mod:`.routes_dashboard`): ``GET .../adaptation/series`` (the
  adaptation over time, :mod:`.series`) and ``GET /dashboard`` (the live page charting it)

Errors answer with the protocol's ``{"error": "..."}`` and a 4xx status; nothing that fails
validation reaches the worker, so bad input never touches the adaptation state.

Admin endpoints (reset, freeze, GET and PUT state) need ``Authorization: Bearer <token>`` when a
token is set (``--admin-token`` or ``EVA0_ADMIN_TOKEN``); without a token they are open on a
loopback bind only, to requests whose ``Host`` names this machine, and answer 403 elsewhere; a
browser's cross-site ``Origin`` is refused either way (:func:`.context.admin_check`). Inference,
health, statistics, the series, the dashboard and metrics stay open. No interactive docs or
OpenAPI schema are served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from eva0_edge import __version__

from ..policy import Policy
from .context import ServerContext, StepSummary, error_response, log
from .extension import ServerExtension
from .metrics import ServerMetrics
from .options import ServeOptions
from .protocol import ProtocolError
from .routes_adaptation import adaptation_router, metrics_router
from .routes_dashboard import dashboard_router
from .routes_oip import oip_router
from .routes_triton import triton_router
from .series import AdaptationSeries, reading
from .snapshots import SnapshotStore
from .worker import AdaptationWorker, StepRecord

__all__ = ["create_app"]


def create_app(
    model: Policy, options: ServeOptions, extension: ServerExtension | None = None
) -> FastAPI:
    """The application around ``model``, restored from the newest good snapshot in
    ``options.state_dir`` (StateMismatch when the directory holds a history this server cannot
    use); the worker starts and stops with the app's lifespan, ``extension`` (see
    :mod:`.extension`) right after and before it. FOA's search state is not persisted: with
    FOA, ``state_dir`` is refused (ValueError)."""
    if options.state_dir and not model.spec.keeps_state:
        raise ValueError(
            f"--state-dir: {model.method}'s CMA-ES search state is not persisted; serve it "
            "without --state-dir (the EVA-0 family keeps its state)"
        )
    metrics = ServerMetrics(options.max_batch, extension.gauges if extension else None)
    summary = StepSummary(options.summary_every_s)
    series = AdaptationSeries()
    snapshots = (
        SnapshotStore(options.state_dir, options.keep_snapshots) if options.state_dir else None
    )

    def on_step(record: StepRecord) -> None:
        metrics.record_step(record, model.health())
        summary.add(record, model)
        series.close_if_due(model)

    worker = AdaptationWorker(
        model, options.max_batch, options.max_delay_ms / 1000.0, snapshots,
        options.snapshot_every, on_step, options.adaptive_delay, options.asynchronous,
    )
    if snapshots is not None and model.spec.keeps_state:
        restored = snapshots.restore_latest(model)
        if restored:
            log.info("resumed from %s at step %d", restored, model.health().step)
    ctx = ServerContext(model, options, worker, metrics, snapshots, asyncio.Event(), extension,
                        series=series)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        series.begin(reading(model, model.stats()))  # before the worker owns the model
        worker.start()
        if extension is not None:
            extension.start(worker)
        ctx.ready.set()
        log.info(
            "serving %s (%s, %s) max batch %d, max delay %.1f ms", options.name,
            model.metadata.architecture, model.method, options.max_batch, options.max_delay_ms,
        )
        try:
            yield
        finally:
            ctx.ready.clear()
            if extension is not None:
                await run_in_threadpool(extension.stop)
            await run_in_threadpool(worker.stop)
            summary.emit(model)
            log.info("stopped at step %d", model.health().step)

    app = FastAPI(
        title="eva0-edge", version=__version__, lifespan=lifespan,
        docs_url=None, redoc_url=None, openapi_url=None,
    )

    @app.exception_handler(ProtocolError)
    async def protocol_error(_: Request, err: ProtocolError) -> JSONResponse:
        return error_response(str(err), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """An unrouted path or method: the protocol's error body, naming the route."""
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return error_response(f"{what}: {request.method} {request.url.path[:200]}",
                              err.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request to {request.url.path[:200]}: "
                              f"{str(err.errors())[:300]}", 400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        """A bug, not the client's fault: JSON like every other answer, no object reprs."""
        log.error("internal error: %s: %s", type(err).__name__, err)
        return error_response(f"internal server error ({type(err).__name__})", 500)

    # Triton's routes first: /v2/models/stats is not the metadata of a model named "stats"
    for router in (triton_router(ctx), oip_router(ctx), adaptation_router(ctx),
                   metrics_router(ctx), dashboard_router(ctx)):
        app.include_router(router)
    app.state.worker = worker
    return app
