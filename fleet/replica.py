"""One replica of the fleet: the plain server's FastAPI app (``create_app``: the same Open
Inference Protocol routes, worker, dynamic batching, authentication and limits) behind Ray
Serve's ingress, plus :class:`~.sync.FleetSync`, which reports the replica's adaptation state
to the fleet-state actor and applies the merged state it answers with.

Kept from the plain server, on purpose: its worker thread and dynamic batcher rather than
``@serve.batch``. The worker owns the model (ORT calls block, the state must never be touched by
two threads), batches across every route that steps, answers each request with exactly its own
rows, and waits only while more requests are on their way (``--max-delay-ms`` bounds it);
``@serve.batch`` would batch one method's calls on the event loop and still need the worker to
own the state. Ray Serve does the rest: the proxy, routing to replicas, restarts.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server import ServeOptions, create_app
from eva0_edge.runtime.session import SessionSettings

from .sync import FleetSync, ray_actor


@dataclass
class ReplicaSpec:
    """What every replica loads and how it syncs: the adaptable file ``path`` under ``method``
    with the hyper-parameter overrides ``config``, run by ORT as ``session`` says, served with
    ``options``; ``sync_every_s``: seconds between reports to the fleet state (0: none);
    ``seed``: the perturbation seed, offset per replica so replicas explore different
    directions."""

    path: str
    method: str
    options: ServeOptions
    config: dict[str, Any] = field(default_factory=dict)
    session: SessionSettings = field(default_factory=SessionSettings)
    sync_every_s: float = 2.0
    seed: int = 0

    def load(self, seed: int | None = None) -> Policy:
        """The replica's model (``seed``: its own; default the spec's)."""
        return load_method(self.path, self.method, self.config,
                           self.seed if seed is None else seed, self.session)


def replica_app(spec: ReplicaSpec, actor: Any) -> Callable[[], Any]:
    """The builder of one replica's ASGI app for Serve's documented ``serve.ingress(builder)``
    (evaluated on each replica as it starts): it loads the model under a seed of its own,
    joins the fleet-state ``actor`` and returns ``create_app``'s application."""

    def build() -> Any:
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        seed = spec.seed + zlib.crc32(replica.encode()) % 100_000
        model = spec.load(seed)
        if not model.spec.keeps_state:
            raise ValueError(f"the fleet merges EVA-0-family states; {spec.method} keeps none")
        options = dataclasses.replace(spec.options, replica=replica)  # named in its series
        return create_app(model, options,
                          FleetSync(ray_actor(actor), replica, model, spec.sync_every_s))

    return build
