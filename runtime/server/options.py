"""The server's settings and their defaults, in one place: ``serve``'s argparse options and the
fleet's application builder read their defaults from :class:`ServeOptions`. No FastAPI here,
so the CLI reads them without importing the server stack."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class ServeOptions:
    """Server settings. ``max_delay_ms``: how long the oldest queued request may wait for others to
    join its step; ``adaptive_delay``: wait only while announced requests are still being
    decoded (see :mod:`.worker`), else up to ``max_delay_ms`` always; ``asynchronous``: answer
    from one forward and adapt on answered inputs while idle (see :mod:`.worker`);
    ``snapshot_every``: steps between snapshots; ``max_body_mb``: the largest request body
    accepted (MiB);
    ``summary_every_s``: seconds between info-level summaries; ``max_pixels_mp``: decoded
    megapixels per ``images`` request; ``admin_token``: the bearer token of the admin endpoints;
    ``loopback``: the server binds a loopback address only (admin endpoints are open there
    without a token); ``body_timeout_s``: the longest a request body may take to arrive;
    ``header_timeout_s``: the longest a request's headers may take, from the connection's
    opening or the previous response (then 408 and the connection is closed); ``host``: the
    address bound (admin requests may name it in ``Host``)."""

    name: str
    max_batch: int = 64
    max_delay_ms: float = 10.0
    adaptive_delay: bool = True
    asynchronous: bool = False
    state_dir: str | None = None
    snapshot_every: int = 100
    keep_snapshots: int = 3
    max_body_mb: float = 64.0
    summary_every_s: float = 30.0
    max_pixels_mp: float = 16.0
    admin_token: str | None = None
    loopback: bool = True
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    host: str = "127.0.0.1"


def serve_defaults() -> dict[str, Any]:
    """Every :class:`ServeOptions` field with a default, by name."""
    return {f.name: f.default for f in fields(ServeOptions) if f.name != "name"}
