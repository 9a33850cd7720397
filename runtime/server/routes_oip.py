"""The Open Inference Protocol routes: health, server and model metadata, inference."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from eva0_edge import __version__

from ..session import InputError
from .context import MODEL_VERSION, ServerContext, error_response, log
from .inference_stats import RequestTimes
from .protocol import HEADER_LENGTH, ProtocolError, encode_infer_response, parse_infer_request
from .routes_triton import EXTENSIONS
from .tensors import OutputPlan, model_input, model_metadata, model_outputs, plan_outputs


def check_finite_rows(ctx: ServerContext, logits: np.ndarray, plans: list[OutputPlan]) -> None:
    """Count rows of ``logits`` [B, K] that are not finite; when a JSON output would carry them
    (JSON has no NaN), answer 500 naming them instead (binary outputs carry IEEE values)."""
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if not bad.size:
        return
    ctx.count_non_finite(int(bad.size))
    if any(not plan.binary and plan.name != "labels" for plan in plans):
        raise ProtocolError(
            f"rows {bad[:8].tolist()} of the model's output are not finite; JSON cannot carry "
            "them (ask for binary outputs to receive them as they are)", 500,
        )


def oip_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    model, options, worker = ctx.model, ctx.options, ctx.worker

    @router.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def server_ready() -> Response:
        return Response(status_code=200 if ctx.ready.is_set() and worker.alive else 503)

    @router.get("/v2")
    async def server_metadata() -> dict:
        return {
            "name": "eva0-edge", "version": __version__,
            "extensions": ["binary_tensor_data", *EXTENSIONS, "eva0_adaptation"],
        }

    named = [Depends(ctx.check_name)]

    @router.get("/v2/models/{name}", dependencies=named)
    @router.get("/v2/models/{name}/versions/{version}", dependencies=named)
    async def metadata() -> dict:
        return model_metadata(options.name, MODEL_VERSION, model.metadata)

    @router.get("/v2/models/{name}/ready", dependencies=named)
    @router.get("/v2/models/{name}/versions/{version}/ready", dependencies=named)
    async def model_ready() -> Response:
        return Response(status_code=200 if ctx.ready.is_set() else 503)

    def prepare(body: bytes | bytearray, header_length: str | None, times: RequestTimes):
        """The parsed request, its output plans and its checked input; the time it took in
        ``times.compute_input``."""
        start = time.perf_counter()
        request = parse_infer_request(body, header_length)
        plans = plan_outputs(request.outputs, request.binary_output, model.metadata.num_classes)
        x = model_input(request, model.metadata, options.max_batch, ctx.max_pixels)
        try:
            x = model.session.check_input(x)
        except InputError as err:
            raise ProtocolError(str(err)) from None
        times.compute_input = time.perf_counter() - start
        return request, plans, x

    @router.post("/v2/models/{name}/infer")
    @router.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = MODEL_VERSION) -> Response:
        """Inference; it checks the name inside its own error handling, not as a dependency,
        so that its metrics count every answer (a 404 included)."""
        start = time.perf_counter()
        status = 200
        rows = 0
        announced = False
        times = RequestTimes()
        try:
            ctx.check_name(name, version)
            if not ctx.ready.is_set() or not worker.alive:
                raise ProtocolError("server is not ready", 503)
            worker.announce()  # a forming batch may wait for this request while it decodes
            announced = True
            body = await ctx.read_body(request)
            parsed, plans, x = await run_in_threadpool(
                prepare, body, request.headers.get(HEADER_LENGTH), times
            )
            rows = x.shape[0]
            future = worker.submit(x, announced=True, times=times)
            announced = False
            logits = await asyncio.wrap_future(future)
            encoding = time.perf_counter()
            check_finite_rows(ctx, logits, plans)
            outputs = model_outputs(logits, plans, model.metadata.labels)
            content, headers = encode_infer_response(
                options.name, MODEL_VERSION, parsed.id, outputs
            )
            times.compute_output = time.perf_counter() - encoding
            return Response(content, headers=headers)
        except ProtocolError as err:
            status = err.status
            return error_response(str(err), status)
        except Exception as err:
            status = 500
            log.exception("inference failed")
            return error_response(f"inference failed ({type(err).__name__})", status)
        finally:
            if announced:
                worker.withdraw()
            elapsed = time.perf_counter() - start
            ctx.inference.record(status == 200, elapsed, rows, times)
            ctx.metrics.requests.labels(str(status)).inc()
            if status == 200:
                ctx.metrics.latency.observe(elapsed)
                ctx.series.record_request(elapsed, rows)
            log.debug("infer %s %d %.1f ms", name, status, 1000 * elapsed)

    return router
