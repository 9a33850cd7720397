"""Run the server with uvicorn until SIGINT/SIGTERM (the lifespan writes the final snapshot),
logging the URL it listens on once its socket is bound (``--port 0``: any free port)."""

from __future__ import annotations

import logging
import os
import socket

import uvicorn

from ..policy import Policy
from .app import create_app
from .context import log
from .deadline import header_deadline_protocol
from .options import ServeOptions


def listening_url(address: tuple) -> str:
    """``http://HOST:PORT/`` of a bound socket's ``getsockname()`` (IPv6 hosts bracketed)."""
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (what binding port 0 there picks), for a server that
    binds by number later (the fleet's proxy)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's server, logging one ``listening on URL`` line (info, ``eva0_edge.serve``) with
    the address and port actually bound once its sockets listen."""

    def __init__(self, config: uvicorn.Config, model_name: str) -> None:
        super().__init__(config)
        self.model_name = model_name

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            urls = [listening_url(sock.getsockname())
                    for server in self.servers for sock in server.sockets]
            log.info("listening on %s (inference: POST %sv2/models/%s/infer)",
                     ", ".join(urls), urls[0], self.model_name)


def run_server(
    model: Policy, options: ServeOptions, host: str = "127.0.0.1", port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serve ``model`` on ``host:port`` (loopback by default; port 0: any free one, logged)
    until interrupted."""
    logging.getLogger("eva0_edge").setLevel(log_level.upper())
    app = create_app(model, options)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=10, http=header_deadline_protocol(options.header_timeout_s),
    )
    _AnnouncingServer(config, options.name).run()
    if app.state.worker.abandoned_pass:
        # the snapshot is written; the abandoned pass's thread would hold the interpreter's exit
        # (it joins executor threads) for as long as the host starves it
        logging.shutdown()
        os._exit(0)
