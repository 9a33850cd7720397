"""The fleet as a Ray Serve application builder, for Serve's own tools: ``serve run`` and
``serve deploy`` config files, and KubeRay's ``RayService`` (``deploy/rayservice.yaml``).

    serve run eva0_edge.fleet.app:build model=models/resnet_gn_fmnist.onnx replicas=2

The builder is typed (Serve's documented typed application builder): Serve validates its
arguments into :class:`FleetArgs`, whose fields, types and defaults say what it takes; the
server's defaults are :class:`~eva0_edge.runtime.server.ServeOptions`', the merge's
:class:`~.state_actor.FleetConfig`'s. The admin token comes from ``EVA0_ADMIN_TOKEN`` in the
replicas' environment; without one the admin endpoints answer 403 (Serve's proxy is not a
loopback bind).

No ``from __future__ import annotations`` here: Serve reads ``build``'s annotation at run time
to find the model it validates into.
"""

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eva0_edge.runtime.server import ServeOptions
from eva0_edge.runtime.server.options import serve_defaults
from eva0_edge.runtime.session import SessionSettings

from .replica import ReplicaSpec
from .serve import fleet_application
from .state_actor import FleetConfig

SERVE = serve_defaults()
FLEET = FleetConfig()


class FleetArgs(BaseModel):
    """What ``build`` takes. ``model``: the adaptable ``.onnx`` file; ``method``: a runtime
    method keeping a state (the EVA-0 family); ``name``: the model's name in the URLs (default:
    the file's stem); ``sync_every_s``: seconds between a replica's reports (0: no merging);
    ``threshold`` / ``combine`` / ``state_dir``: the merge (see
    :class:`~.state_actor.FleetConfig`); ``threads``: ORT intra-op threads per replica
    (default ORT's); ``replica_cpus``: Ray CPUs per replica. Unknown arguments are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str
    method: str = "eva0"
    name: str | None = None
    replicas: int = Field(2, ge=1)
    sync_every_s: float = Field(2.0, ge=0)
    threshold: float = FLEET.threshold
    combine: Literal["sum", "mean"] = "mean"
    state_dir: str | None = None
    threads: int | None = Field(None, ge=1)
    max_batch: int = Field(SERVE["max_batch"], ge=1)
    max_delay_ms: float = Field(SERVE["max_delay_ms"], ge=0)
    replica_cpus: float = Field(1.0, gt=0)


def build(args: FleetArgs) -> Any:
    """The application for ``args``; Serve passes them as strings and validates them into
    :class:`FleetArgs` (a bad or unknown argument is refused, naming it)."""
    options = ServeOptions(
        name=args.name or Path(args.model).stem, max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        admin_token=os.environ.get("EVA0_ADMIN_TOKEN") or None, loopback=False,
    )
    spec = ReplicaSpec(args.model, args.method, options,
                       session=SessionSettings(threads=args.threads),
                       sync_every_s=args.sync_every_s)
    config = FleetConfig(threshold=args.threshold, combine=args.combine,
                         state_dir=args.state_dir)
    return fleet_application(spec, args.replicas, config, args.replica_cpus)
