"""The server's settings and their defaults, in one place: ``serve``'s argparse options and the
fleet's application builder read their defaults from :class:`ServeOptions`. No FastAPI here,
so the CLI reads them without importing the server stack."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# field -> (the serve option that sets it, the least value, whether the least is allowed, the
# most): every number is checked when the options are made (a server never starts on a value
# that would kill its worker or refuse every request)
LIMITS: dict[str, tuple[str, float, bool, float]] = {
    "max_batch": ("--max-batch", 1, True, math.inf),
    "max_delay_ms": ("--max-delay-ms", 0.0, True, 60_000.0),
    "snapshot_every": ("--snapshot-every", 1, True, math.inf),
    "keep_snapshots": ("--keep-snapshots", 1, True, math.inf),
    "max_body_mb": ("--max-body-mb", 0.0, False, math.inf),
    "summary_every_s": ("--summary-every", 0.0, False, math.inf),
    "max_pixels_mp": ("--max-pixels-mp", 0.0, False, math.inf),
    "body_timeout_s": ("body_timeout_s", 0.0, False, math.inf),
    "header_timeout_s": ("--header-timeout-s", 0.0, False, math.inf),
}
REPLICA_CHARS = 100  # the longest replica name


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
    address bound (admin requests may name it in ``Host``); ``replica``: this server's name in
    its series (``GET .../adaptation/series``), where several serve one model behind one
    address (each fleet replica's own id; ``--replica-id`` on a server behind a load balancer;
    None: a lone server)."""

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
    replica: str | None = None

    def __post_init__(self) -> None:
        """ValueError naming the option of the first number out of its range (:data:`LIMITS`):
        not a number, not finite, below its least or above its most."""
        for name, (option, least, inclusive, most) in LIMITS.items():
            value = getattr(self, name)
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{option} must be a number, got {value!r}") from None
            low_ok = number >= least if inclusive else number > least
            if not (math.isfinite(number) and low_ok and number <= most):
                bound = f"{'>=' if inclusive else '>'} {least:g}" + (
                    f" and <= {most:g}" if math.isfinite(most) else "")
                raise ValueError(f"{option} must be a finite number {bound}, got {value!r}")
        if self.replica is not None and not 0 < len(self.replica) <= REPLICA_CHARS:
            raise ValueError(f"--replica-id must be 1..{REPLICA_CHARS} characters, "
                             f"got {self.replica[:REPLICA_CHARS + 1]!r}")


def serve_defaults() -> dict[str, Any]:
    """Every :class:`ServeOptions` field with a default, by name."""
    return {f.name: f.default for f in fields(ServeOptions) if f.name != "name"}
