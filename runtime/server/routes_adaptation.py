"""The adaptation extension (statistics, reset, freeze, state get/put) and Prometheus metrics.
Reset, freeze and both state routes are admin endpoints (:func:`.context.admin_check`): the
state holds the adapted parameters, which are the deployment's to hand out; statistics and
metrics (counters and health, no parameters) stay open for monitoring."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..policy import Policy
from ..state import StateError
from .context import ServerContext, admin_check, error_response, finite_stats
from .model_series import model_families
from .protocol import ProtocolError

FREEZE_BODY_LIMIT = 1024  # bytes: {"frozen": false} and some whitespace


def adaptation_router(ctx: ServerContext) -> APIRouter:
    """Every route checks the model's name first (``ctx.check_name``), then, for the admin
    ones, the admin rule (``ctx.admin``), as FastAPI dependencies in that order."""
    router = APIRouter(prefix="/v2/models/{name}/adaptation",
                       dependencies=[Depends(ctx.check_name)])
    worker, options = ctx.worker, ctx.options
    admin_json = Depends(ctx.admin(body="application/json"))
    admin = Depends(ctx.admin())

    def admin_reset(request: Request) -> None:
        """Reset takes no body: with a Content-Type it must be JSON (a form post is refused)."""
        has_body = "content-type" in request.headers
        admin_check(request, options, body="application/json" if has_body else None)

    def answer(m: Policy) -> dict:
        """The statistics after an admin change, and whether its snapshot was written."""
        return {**finite_stats(m.stats()), "snapshot_written": worker.snapshot_now()}

    def snapshot_of_counts(m: Policy) -> dict:
        """Every counter read in one call on the worker thread, between two batches: one
        snapshot, its sample counts agreeing with each other under any load."""
        stats = m.stats()
        stats["snapshots_written"] = ctx.snapshots.written if ctx.snapshots else 0
        stats["non_finite_rows"] = ctx.non_finite_rows
        stats["input_changes"] = m.inputs.changes  # the input change detector's (the series')
        if ctx.options.asynchronous:
            stats["asynchronous"] = ctx.worker.counts()
        return stats

    @router.get("/statistics")
    async def statistics() -> dict:
        stats = await ctx.on_worker(snapshot_of_counts)
        if ctx.extension is not None:
            stats[ctx.extension.name] = ctx.extension.statistics()
        return finite_stats(stats)

    @router.post("/reset", dependencies=[Depends(admin_reset)])
    async def reset() -> dict:
        def do_reset(m: Policy) -> dict:
            m.reset()
            if ctx.extension is not None:
                ctx.extension.state_replaced(m)
            return answer(m)

        return await ctx.on_worker(do_reset)

    @router.post("/freeze", dependencies=[admin_json])
    async def freeze(request: Request) -> dict:
        """Body ``{"frozen": true|false}``: predict without adapting, or resume."""
        body = await ctx.read_body(request, FREEZE_BODY_LIMIT)
        try:
            frozen = json.loads(body)["frozen"]
        except (ValueError, KeyError, TypeError, RecursionError):
            frozen = None
        if not isinstance(frozen, bool):
            raise ProtocolError('freeze needs a JSON body {"frozen": true} or {"frozen": false}')

        def do_freeze(m: Policy) -> dict:
            m.freeze(frozen)
            return answer(m)

        return await ctx.on_worker(do_freeze)

    def stateful_model() -> Policy:
        """The served model when it keeps a state (the EVA-0 family); 409 for FOA."""
        if not ctx.model.spec.keeps_state:
            raise ProtocolError(
                f"{ctx.model.method}'s CMA-ES search state is not persisted: no state to get "
                "or put", 409,
            )
        return ctx.model

    @router.get("/state", dependencies=[admin])
    async def get_state() -> Response:
        stateful_model()
        data = await ctx.on_worker(lambda m: m.state_bytes())
        return Response(data, media_type="application/octet-stream")

    @router.put("/state", dependencies=[admin])  # PUT: a browser preflights it, never granted
    async def put_state(request: Request) -> Response:
        model = stateful_model()
        body = bytes(await ctx.read_body(request))
        try:  # decoded and validated off the worker thread: inference goes on meanwhile
            state = await run_in_threadpool(model.parse_state_bytes, body)
        except StateError as err:
            return error_response(f"state refused: {err}", 400)

        def install(m: Policy) -> dict:
            m.install_state(state)
            if ctx.extension is not None:
                ctx.extension.state_replaced(m)
            return answer(m)

        return JSONResponse(await ctx.on_worker(install))

    return router


def metrics_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def prometheus() -> Response:
        """The server's metrics and the model's own series, read between two batches (on the
        worker thread, as the statistics route reads them)."""
        families = await ctx.on_worker(model_families)
        return Response(ctx.metrics.exposition(families), media_type="text/plain; version=0.0.4")

    return router
