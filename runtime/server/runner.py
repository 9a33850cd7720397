"""Run the server with uvicorn until SIGINT/SIGTERM (the lifespan writes the final snapshot)."""

from __future__ import annotations

import logging

import uvicorn

from ..policy import Policy
from .app import create_app
from .deadline import header_deadline_protocol
from .options import ServeOptions


def run_server(
    model: Policy, options: ServeOptions, host: str = "127.0.0.1", port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serve ``model`` on ``host:port`` (loopback by default) until interrupted."""
    logging.getLogger("eva0_edge").setLevel(log_level.upper())
    app = create_app(model, options)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=10, http=header_deadline_protocol(options.header_timeout_s),
    )
    uvicorn.Server(config).run()
