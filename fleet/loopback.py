"""Keeps a local fleet's Ray Serve processes on loopback.

``init_ray`` starts a local Ray instance on the loopback address (Ray's single-machine mode), so
Ray's own servers listen there. Ray Serve 2.60 still binds three sockets of its own on every
interface whatever the instance's address: HAProxy's Prometheus and stats frontends (``bind
:port`` in its config template) and each replica's inter-deployment gRPC server (``[::]:0``),
with no setting for either. :func:`keep_on_loopback` is installed as the instance's worker setup
hook (Ray's ``worker_process_setup_hook``, run in every worker process before it serves) and
rewrites those binds to 127.0.0.1. It touches Serve internals:
``tests/integration/test_fleet.py`` lists every listening socket of a running fleet, so a Ray
release that moves them fails there.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_WILDCARD_BINDS = (
    ("bind :{{ config.metrics_port }}", f"bind {LOOPBACK}:{{{{ config.metrics_port }}}}"),
    ("bind *:{{ config.stats_port }}", f"bind {LOOPBACK}:{{{{ config.stats_port }}}}"),
)


def keep_on_loopback() -> None:
    """Ray worker setup hook: HAProxy's metrics and stats frontends and the replicas' gRPC
    server bind 127.0.0.1 instead of every interface (a no-op where Serve is not imported)."""
    try:
        from ray.serve._private import haproxy, replica
    except ImportError:  # Serve not installed: nothing of it runs here
        return
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    for wildcard, local in _WILDCARD_BINDS:
        template = template.replace(wildcard, local)
    haproxy.HAPROXY_CONFIG_TEMPLATE = template
    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "keeps_loopback", False):
        return

    def add_loopback_port(server, address: str) -> int:
        host, _, port = address.rpartition(":")
        return add_port(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0") else address)

    add_loopback_port.keeps_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_loopback_port
