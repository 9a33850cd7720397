"""The operator's view: the adaptation's time series as JSON
(``GET /v2/models/{name}/adaptation/series[?since=T]``, see :mod:`.series`) and the live page
that charts it (``GET /dashboard``, its files under ``GET /dashboard/{file}``).

Both are read-only and open, under the statistics route's rule: counters and health, no
parameters, so no admin check (the admin endpoints are reset, freeze and the state). The page
loads nothing from outside the server: its script and style are this package's
(``dashboard/``), its chart library uPlot is copied into ``static/`` from the npm registry by
``make setup`` (``dashboard/package.json``, ``npm ci``), and its Content-Security-Policy lets it
load and connect to its own origin only. Without the copied files ``/dashboard`` answers 503
naming the step that installs them.

A series answer names the server that answered (``replica``: :attr:`.ServeOptions.replica`, a
fleet replica's id; None on a lone server): behind a load balancer each replica answers its own
ring, and the page and ``top`` keep each replica's points apart by it.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from .context import ServerContext, error_response
from .protocol import ProtocolError
from .series import FIELDS, GUARD_STATES, bounds_of

HERE = Path(__file__).resolve().parent
PAGE_DIR = HERE / "dashboard"  # the page's own files (in git)
VENDOR_DIR = HERE / "static"  # uPlot, copied by `make setup` (not in git)
VENDOR_FILES = ("uPlot.iife.min.js", "uPlot.min.css")
PAGE_FILES = ("dashboard.js", "dashboard.css")
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
INSTALL_HINT = (
    "the dashboard's chart library is not installed: run `make setup` (its npm step: `npm ci "
    "--prefix dashboard`, then copy dashboard/node_modules/uplot/dist/uPlot.iife.min.js and "
    "uPlot.min.css into eva0_edge/runtime/server/static/) and reinstall"
)
# the page may load and connect to its own origin only
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-cache"}


def parse_since(text: str | None) -> float | None:
    """The ``since`` query value: epoch seconds, a finite number >= 0 (400 otherwise)."""
    if text is None:
        return None
    try:
        since = float(text)
    except ValueError:
        since = math.nan
    if not (math.isfinite(since) and since >= 0):
        raise ProtocolError(f"since must be a finite number of seconds since the epoch >= 0, "
                            f"got {text[:50]!r}")
    return since


def missing_vendor_files() -> list[str]:
    return [name for name in VENDOR_FILES if not (VENDOR_DIR / name).is_file()]


def dashboard_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    series, options = ctx.series, ctx.options

    @router.get("/v2/models/{name}/adaptation/series", dependencies=[Depends(ctx.check_name)])
    async def adaptation_series(since: str | None = None) -> JSONResponse:
        after = parse_since(since)
        if series.due() and ctx.ready.is_set() and ctx.worker.alive:
            # an idle server closes its point here, reading the model on the worker thread
            await ctx.on_worker(series.close_if_due)
        body = {
            "model": options.name, "replica": options.replica, "interval_s": series.interval_s,
            "capacity": series.capacity, "fields": list(FIELDS),
            "guard_states": list(GUARD_STATES), "bounds": bounds_of(ctx.model),
            "points": series.points_since(after), "events": series.events_since(after),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @router.get("/dashboard")
    async def dashboard() -> Response:
        missing = missing_vendor_files()
        if missing:
            return error_response(f"{INSTALL_HINT} (missing: {', '.join(missing)})", 503)
        page = (PAGE_DIR / "index.html").read_text(encoding="utf-8")
        page = page.replace("{{MODEL}}", html.escape(options.name, quote=True))
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={**SECURITY_HEADERS, "Content-Security-Policy": PAGE_POLICY})

    @router.get("/dashboard/{file}")
    async def dashboard_file(file: str) -> Response:
        if file in PAGE_FILES:
            path = PAGE_DIR / file
        elif file in VENDOR_FILES:
            path = VENDOR_DIR / file
            if not path.is_file():
                return error_response(f"{INSTALL_HINT} (missing: {file})", 503)
        else:
            return error_response(f"no such dashboard file: {file[:100]!r}", 404)
        return Response(path.read_bytes(), media_type=MEDIA_TYPES[path.suffix],
                        headers=SECURITY_HEADERS)

    return router
