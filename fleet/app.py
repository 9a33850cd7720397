"""The fleet as a Ray Serve application builder, for Serve's own tools: ``serve run`` and
``serve deploy`` config files, and KubeRay's ``RayService`` (``deploy/rayservice.yaml``).

    serve run eva0_edge.fleet.app:build model=models/resnet_gn_fmnist.onnx replicas=2

Arguments (strings, as Serve passes them): ``model`` (required), ``method`` (eva0), ``name``
(the file's stem), ``replicas`` (2), ``sync_every_s`` (2), ``threshold`` (1.0), ``state_dir``
(none), ``threads`` (ORT's default), ``max_batch`` (64), ``max_delay_ms`` (10),
``replica_cpus`` (1), ``combine`` (mean). The admin token comes from ``EVA0_ADMIN_TOKEN`` in the
replicas' environment; without one the admin endpoints answer 403 (Serve's proxy is not a
loopback bind).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eva0_edge.runtime.server import ServeOptions

from .replica import ReplicaSpec
from .serve import fleet_application
from .state_actor import FleetConfig

KNOWN = {"model", "method", "name", "replicas", "sync_every_s", "threshold", "state_dir",
         "threads", "max_batch", "max_delay_ms", "replica_cpus", "combine"}


def build(args: dict[str, str]) -> Any:
    """The application for ``args`` (see the module docstring); ValueError names an unknown
    or missing argument."""
    unknown = sorted(set(args) - KNOWN)
    if unknown or "model" not in args:
        raise ValueError(f"fleet arguments: unknown {unknown}, need model=...; known "
                         f"{sorted(KNOWN)}")
    model = args["model"]
    options = ServeOptions(
        name=args.get("name", Path(model).stem), max_batch=int(args.get("max_batch", 64)),
        max_delay_ms=float(args.get("max_delay_ms", 10.0)),
        admin_token=os.environ.get("EVA0_ADMIN_TOKEN") or None, loopback=False,
    )
    threads = int(args["threads"]) if "threads" in args else None
    spec = ReplicaSpec(
        {"path": model, "name": args.get("method", "eva0"), "threads": threads},
        options, float(args.get("sync_every_s", 2.0)),
    )
    config = FleetConfig(
        threshold=float(args.get("threshold", 1.0)), combine=args.get("combine", "mean"),
        state_dir=args.get("state_dir"),
    )
    return fleet_application(spec, int(args.get("replicas", 2)), config,
                             float(args.get("replica_cpus", 1.0)))
