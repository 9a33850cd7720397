"""A hostile client against a real ``eva0-edge serve`` process at its default limits: every
answer is a JSON 4xx naming the problem, the state stays as it was, no request raises the
server's memory by more than the budget, and the health route keeps answering meanwhile."""

from __future__ import annotations

import base64
import io
import json
import statistics as stats
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server.context import ServeOptions
from eva0_edge.runtime.server.protocol import HEADER_LENGTH, MAX_JSON_BYTES, MAX_JSON_VALUES
from eva0_edge.runtime.state import encode_state
from tests.fixtures import MODEL, NAME, ServerProcess, http_call

INFER = f"/v2/models/{NAME}/infer"
ADAPTATION = f"/v2/models/{NAME}/adaptation"
MEMORY_BUDGET = 256 * 2**20  # bytes over idle, per request, at the default limits (README)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The plain server at its default limits (64 MiB bodies, 16 MP per request)."""
    process = ServerProcess(tmp_path_factory.mktemp("hostile") / "server.log")
    yield process
    assert process.stop(), process.log()


def _json(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _png(width: int, height: int, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def _images(*encoded: bytes) -> bytes:
    """An ``images`` request with binary BYTES data, as tritonclient sends it."""
    data = b"".join(len(e).to_bytes(4, "little") + e for e in encoded)
    head = _json([{"name": "images", "datatype": "BYTES", "shape": [len(encoded)],
                   "parameters": {"binary_data_size": len(data)}}])
    return head + data, {HEADER_LENGTH: str(len(head))}


def _pixels(batch: int = 1) -> dict:
    return {"name": "pixel_values", "datatype": "FP32", "shape": [batch, 3, 32, 32],
            "data": [0.0] * (batch * 3 * 32 * 32)}


def _statistics(server) -> dict:
    status, body = http_call(server, "GET", f"{ADAPTATION}/statistics")
    assert status == 200, body
    return json.loads(body)


def _state(server) -> bytes:
    status, body = http_call(server, "GET", f"{ADAPTATION}/state")
    assert status == 200, body
    return body


def _rss(server, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of the server process, in bytes."""
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _refused(server, method: str, path: str, body: bytes | None, headers: dict | None,
             status: int, message: str) -> None:
    got, answer = http_call(server, method, path, body, headers, timeout=120)
    assert got == status, (message, answer[:300])
    error = json.loads(answer)["error"]
    assert message in error and " at 0x" not in error, error


def test_malformed_requests_get_a_json_4xx_and_leave_the_state(server):
    before, state = _statistics(server), _state(server)
    pixels = _pixels()
    cases = [
        (_json([{**pixels, "datatype": ["FP32"]}]), None, 400, "'datatype' must be a string"),
        (_json([{**pixels, "datatype": {"a": 1}}]), None, 400, "'datatype' must be a string"),
        (_json([pixels], outputs=[{"name": "logits"}] * 20000), None, 400,
         "output 'logits' requested twice"),
        (_json([pixels], id=["x"]), None, 400, "'id' must be a string"),
        (_json([pixels], id="x" * 5000), None, 400, "'id' must be a string"),
        (_json([{"name": "images", "datatype": "BYTES", "shape": [10**6],
                 "data": ["QQ=="]}]), None, 413, "BYTES elements, over the server's limit"),
        (b'{"inputs": [' + b"[]," * (MAX_JSON_VALUES + 1) + b"1]}", None, 413,
         "values, over the server's limit"),
        (b" " * (MAX_JSON_BYTES + 1), None, 413, "JSON part is"),
        (*_images(b"\x89PNG\r\n\x1a\nnot really"), 400, "images[0] is not a decodable"),
    ]
    for body, headers, status, message in cases:
        _refused(server, "POST", INFER, body, headers, status, message)
    after = _statistics(server)
    assert after["steps"] == before["steps"] and _state(server) == state
    assert server.client.is_server_ready()


def _resigned(state_bytes: bytes, model: Policy, **changes) -> bytes:
    from eva0_edge.runtime.state import decode_state

    state, _ = decode_state(state_bytes)
    for name, value in changes.items():
        setattr(state, name, value)
    return encode_state(state, model.fingerprint, {})


def _with_meta(state_bytes: bytes, meta) -> bytes:
    """``state_bytes``' arrays under a crafted ``__meta__``."""
    with np.load(io.BytesIO(state_bytes)) as npz:
        arrays = {name: npz[name] for name in npz.files if name != "__meta__"}
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)), **arrays)
    return buf.getvalue()


def _huge_header_archive() -> bytes:
    """A theta member whose .npy header declares 2^40 floats over 16 bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (2**40,)}
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("theta.npy", header.getvalue() + b"\0" * 16)
    return buf.getvalue()


def test_hostile_states_are_refused_by_name_and_the_state_kept(server):
    model = Policy.load(MODEL, "eva0", provider="cpu", threads=1)
    assert http_call(server, "POST", INFER, _json([_pixels(4)]))[0] == 200  # one step
    current = _state(server)
    p = model.metadata.num_params
    far = (model.metadata.theta0 + 1e30 / np.sqrt(p)).astype(np.float32)
    cases = [
        (_with_meta(current, [1, 2]), "'__meta__' must be a JSON object"),
        (_with_meta(current, {"version": "x"}), "version must be an integer"),
        (_huge_header_archive(), "declares a float32 array of shape [1099511627776]"),
        (_resigned(current, model, theta=np.full(p, 1e300)), "theta holds values beyond float32"),
        (_resigned(current, model, theta=far), "state theta is 1e+30 from theta0"),
        (_resigned(current, model, anchor=far), "state anchor is 1e+30 from theta0"),
        (_resigned(current, model, pause_left=2**62), "pause_left = 4611686018427387904"),
    ]
    for body, message in cases:
        _refused(server, "PUT", f"{ADAPTATION}/state", body, None, 400, message)
    assert _state(server) == current


def test_admin_routes_refuse_other_hosts_origins_and_form_posts(server):
    """Loopback bind, no token: what a web page (cross-site or DNS-rebound) can send is
    refused; a local client naming this machine is served."""
    frozen = f"{ADAPTATION}/freeze"
    body = json.dumps({"frozen": True}).encode()
    as_json = {"Content-Type": "application/json"}
    cases = [
        ("POST", f"{ADAPTATION}/reset", None, {"Host": "evil.example"}, 403, "is not a loopback"),
        ("GET", f"{ADAPTATION}/state", None, {"Host": "evil.example:80"}, 403,
         "is not a loopback"),
        ("POST", f"{ADAPTATION}/reset", None, {"Origin": "http://evil.example"}, 403,
         "origin 'http://evil.example'"),
        ("POST", frozen, body, {**as_json, "Origin": "https://evil.example:8000"}, 403,
         "are refused"),
        ("POST", frozen, body, {"Content-Type": "text/plain"}, 415, "Content-Type application"),
        ("POST", f"{ADAPTATION}/reset", b"x", {"Content-Type": "text/plain"}, 415,
         "Content-Type application/json"),
        ("POST", frozen, b" " * 300_000, as_json, 413, "exceeds the limit of 1024"),
        ("PUT", f"{ADAPTATION}/state", b"x", {"Host": "attacker.test"}, 403, "is not a loopback"),
    ]
    before = _statistics(server)
    for method, path, data, headers, status, message in cases:
        _refused(server, method, path, data, headers, status, message)
    after = _statistics(server)
    assert after["frozen"] is False and after["steps"] == before["steps"]
    status, answer = http_call(server, "POST", frozen, body,
                               {**as_json, "Host": f"localhost:{server.port}",
                                "Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 200 and json.loads(answer)["frozen"] is True
    status, answer = http_call(server, "POST", frozen, json.dumps({"frozen": False}).encode(),
                               as_json)
    assert status == 200 and json.loads(answer)["frozen"] is False


def _heavy_requests() -> list[tuple[str, bytes, dict | None]]:
    """The heaviest requests the default limits allow, and the amplifiers that are refused."""
    side = int(np.sqrt(ServeOptions(NAME).max_pixels_mp * 1e6))  # the whole budget, one image
    json_values = b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1], ' \
        b'"data": [' + b"0.123456789012," * (MAX_JSON_VALUES - 8) + b"1]}]}"
    one_string = _json([{"name": "images", "datatype": "BYTES", "shape": [1],
                         "data": [base64.b64encode(b"\0" * (MAX_JSON_BYTES // 2)).decode()]}])
    binary = np.zeros((5461, 3, 32, 32), np.float32).tobytes()  # a 64 MiB body
    binary_head = _json([{"name": "pixel_values", "datatype": "FP32",
                          "shape": [5461, 3, 32, 32],
                          "parameters": {"binary_data_size": len(binary)}}])
    return [
        ("wide PNG 250000 x 1", *_images(_png(250000, 1))),
        ("tall PNG 1 x 500000", *_images(_png(1, 500000))),
        ("RGBA PNG of the pixel budget", *_images(_png(side, side, "RGBA"))),
        ("RGB PNG of the pixel budget", *_images(_png(side, side, "RGB"))),
        ("palette PNG of the pixel budget", *_images(_png(side, side, "P"))),
        ("63 MiB of []", b'{"inputs": [' + b"[]," * (21 * 2**20) + b"1]}", None),
        (f"{MAX_JSON_VALUES} JSON numbers", json_values, None),
        ("16 MiB JSON string", one_string, None),
        ("64 MiB binary tensor", binary_head + binary, {HEADER_LENGTH: str(len(binary_head))}),
    ]


def test_no_request_raises_memory_beyond_the_budget(server):
    for _ in range(3):  # warm: the allocator's arenas and the first decode are not a request's
        http_call(server, "POST", INFER, *_images(_png(64, 64, "RGB")))
        http_call(server, "POST", INFER, _json([_pixels(4)]))
    peaks = {}
    for name, body, headers in _heavy_requests():
        Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")  # peak := now
        idle = _rss(server, "VmRSS")
        status, answer = http_call(server, "POST", INFER, body, headers, timeout=120)
        assert status in (200, 400, 413), (name, answer[:200])
        peaks[name] = _rss(server, "VmHWM") - idle
        print(f"{name}: {status}, peak RSS over idle {peaks[name] / 2**20:.0f} MiB")
    assert max(peaks.values()) <= MEMORY_BUDGET, peaks


def test_health_answers_while_the_heaviest_requests_run(server):
    """The 100 ms bound of the issue, asserted with 5x slack (a shared 2-core machine)."""
    heavy = _heavy_requests()
    done = threading.Event()

    def hammer() -> None:
        for _ in range(2):
            for _, body, headers in heavy:
                http_call(server, "POST", INFER, body, headers, timeout=120)
        done.set()

    worker = threading.Thread(target=hammer)
    worker.start()
    latencies = []
    while not done.is_set():
        start = time.perf_counter()
        status, _ = http_call(server, "GET", "/v2/health/live", timeout=30)
        latencies.append(time.perf_counter() - start)
        assert status == 200
        time.sleep(0.02)
    worker.join()
    print(f"health: {len(latencies)} probes, median {1000 * stats.median(latencies):.1f} ms, "
          f"max {1000 * max(latencies):.1f} ms")
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


def test_rows_that_are_not_finite_are_counted_and_never_sent_as_json():
    from types import SimpleNamespace

    from eva0_edge.runtime.server.protocol import ProtocolError
    from eva0_edge.runtime.server.routes_oip import check_finite_rows
    from eva0_edge.runtime.server.tensors import OutputPlan

    counted = []
    ctx = SimpleNamespace(count_non_finite=counted.append)
    logits = np.zeros((4, 3), np.float32)
    logits[1, 0], logits[3, 2] = np.nan, np.inf
    check_finite_rows(ctx, logits, [OutputPlan("logits", binary=True)])  # IEEE in binary
    with pytest.raises(ProtocolError, match=r"rows \[1, 3\] .* not finite") as refused:
        check_finite_rows(ctx, logits, [OutputPlan("probabilities", binary=False)])
    assert refused.value.status == 500 and counted == [2, 2]
    check_finite_rows(ctx, logits[[0, 2]], [OutputPlan("logits", binary=False)])
    assert counted == [2, 2]
