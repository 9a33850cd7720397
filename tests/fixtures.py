"""What the tests share: the shipped models' paths, the small timm models they export, data
helpers, and real servers (an ``eva0-edge serve`` process or an in-process app on a free
loopback port)."""

from __future__ import annotations

import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
SHIPPED_VIT = MODELS / "vit_fmnist.onnx"
SHIPPED_RESNET_GN = MODELS / "resnet_gn_fmnist.onnx"
SHIPPED_BN = MODELS / "mobilenet_bn_fmnist.onnx"
SHIPPED = [SHIPPED_VIT, SHIPPED_RESNET_GN, SHIPPED_BN]  # the shipped models, the ViT first
MODEL, NAME = SHIPPED_RESNET_GN, "resnet_gn_fmnist"  # what the server tests serve

SMALL_VIT = (
    "vit_tiny_patch16_224",
    {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 6, "num_heads": 2,
     "num_classes": 10},
)
SMALL_RESNET_GN = (
    "resnet18",
    {"norm_layer": "groupnorm", "layers": [1, 1, 1, 1], "num_classes": 10},
)


@dataclass
class ExportedModel:
    """An exported adaptable model and the checkpoint it came from."""

    arch: str
    kwargs: dict
    checkpoint: Path
    onnx_path: Path
    input_size: tuple[int, int, int]


def export_small(tmp_dir: Path, arch: str, kwargs: dict, seed: int = 0, **export_kw):
    import timm
    import torch

    from eva0_edge.exporter import export_model

    torch.manual_seed(seed)
    model = timm.create_model(arch, **kwargs).eval()
    checkpoint = tmp_dir / f"{arch}.pth"
    torch.save(model.state_dict(), checkpoint)
    onnx_path = tmp_dir / f"{arch}.onnx"
    metadata = export_model(
        arch, onnx_path, checkpoint=checkpoint, model_kwargs=kwargs,
        input_size=(3, 32, 32), **export_kw,
    )
    return ExportedModel(arch, kwargs, checkpoint, onnx_path, metadata.preprocessing.input_size)


def uniform_batch(n: int, seed: int = 0, size=(3, 32, 32)):
    """Normalised pixels as a [0, 1] image normalised with mean = std = 0.5 gives: [-1, 1]."""
    import numpy as np

    return np.random.default_rng(seed).uniform(-1, 1, (n, *size)).astype(np.float32)




def http_call(server: Any, method: str, path: str, body: bytes | None = None,
              headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """One request on a fresh connection to ``server`` (anything with a ``port`` on
    127.0.0.1); (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``eva0-edge serve`` in a subprocess; ``client`` is a tritonclient HTTP client."""

    def __init__(self, log_path: Path, *args: str, model: Path = MODEL,
                 ready_timeout: float = 60.0) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        for attempt in range(3):  # the free port may be taken before the server binds it
            self._start(model, args)
            try:
                self._wait_ready(ready_timeout)
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in self.log():
                    raise

    def _start(self, model: Path, args: tuple[str, ...]) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "eva0_edge.cli", "-v", "serve", "--model", str(model),
            "--port", str(self.port), "--threads", "1", *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        import tritonclient.http as httpclient  # here: the GPU machine's tests have no client

        self.client = httpclient.InferenceServerClient(self.url, concurrency=16)

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if self.client.is_server_ready():
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s: {self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.client.close()

    def stop(self, graceful_marker: str = "stopped at step") -> bool:
        """SIGTERM; True when the server shut down gracefully (it logged ``graceful_marker``:
        the plain server's lifespan ran to the end; uvicorn then re-raises the signal, so the
        status is -15)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)
        self.client.close()
        self._log.close()
        return self.process.returncode in (0, -signal.SIGTERM) and graceful_marker in self.log()


class InProcessServer:
    """An application (``create_app``) under uvicorn in a thread of this process, on a free
    loopback port: for settings the CLI derives from the bind address (``loopback=False``),
    tested without binding beyond 127.0.0.0/8."""

    def __init__(self, app: Any) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def listening_sockets() -> set[tuple[str, int]]:
    """Every TCP socket listening on this machine, as (address, port), from /proc/net."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # the kernel prints each 32-bit word in host (little-endian) order
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(packed) if width == 8 else ipaddress.IPv6Address(packed)
            found.add((str(address), int(hex_port, 16)))
    return found


def beyond_loopback(sockets: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """The sockets of ``sockets`` reachable from another machine (not 127.0.0.0/8 or ::1)."""
    import ipaddress

    def local(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    return {s for s in sockets if not local(s[0])}


BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not available on the device")
            return None
    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300,
    )


STUDIES = ROOT / "studies"


def load_study(folder: str, name: str) -> ModuleType:
    """``studies/<folder>/<name>.py`` as a module (registered, so its dataclasses resolve)."""
    key = f"eva0_edge_study_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, STUDIES / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
