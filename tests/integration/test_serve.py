"""``eva0-edge serve``: a real server process, a real client (tritonclient.http), real images."""

from __future__ import annotations

import base64
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from eva0_edge.runtime.server.app import ServeOptions, create_app
from eva0_edge.runtime.server.protocol import (
    HEADER_LENGTH,
    ProtocolError,
    encode_infer_response,
    parse_infer_request,
)
from eva0_edge.runtime.state import decode_state, encode_state
from tests.fixtures import MODEL, NAME, InProcessServer, ServerProcess, http_call

MAX_BATCH = 32
INFER = f"/v2/models/{NAME}/infer"


@pytest.fixture(scope="module")
def raw_images() -> np.ndarray:
    return load_fashion_mnist("test")[0][:640]


@pytest.fixture(scope="module")
def pixels(raw_images) -> np.ndarray:
    return preprocess_uint8(raw_images, read_metadata(MODEL).preprocessing)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    process = ServerProcess(
        folder / "server.log", "--max-batch", str(MAX_BATCH), "--max-delay-ms", "5",
        "--max-body-mb", "1", "--header-timeout-s", "2",
    )
    yield process
    assert process.stop(), process.log()


def offline(method: str = "eva0") -> Policy:
    return Policy.load(MODEL, method, seed=0, provider="cpu", threads=1)


def tensor_input(x: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def image_input(images: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput("images", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array([png(i) for i in images], dtype=object))
    return tensor


def statistics(server: ServerProcess) -> dict:
    status, body = http_call(server, "GET", f"/v2/models/{NAME}/adaptation/statistics")
    assert status == 200, body
    return json.loads(body)


def reset(server: ServerProcess) -> None:
    status, body = http_call(server, "POST", f"/v2/models/{NAME}/adaptation/reset")
    assert status == 200, body


# ----------------------------------------------------------------------------- protocol
def test_protocol_parses_json_and_binary_tensors():
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    head = json.dumps({
        "id": "r1",
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [1, 2, 3],
             "parameters": {"binary_data_size": 24}},
            {"name": "b", "datatype": "BYTES", "shape": [2],
             "parameters": {"binary_data_size": 11}},
            {"name": "c", "datatype": "INT64", "shape": [2], "data": [[4], [5]]},
        ],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }).encode()
    strings = b"\x03\x00\x00\x00abc" + b"\x00\x00\x00\x00"
    request = parse_infer_request(head + x.tobytes() + strings, str(len(head)))
    np.testing.assert_array_equal(request.inputs["a"], x)
    assert request.inputs["b"] == [b"abc", b""]
    np.testing.assert_array_equal(request.inputs["c"], [4, 5])
    assert request.id == "r1" and request.outputs[0].binary


_BINARY_HEAD = b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], ' \
    b'"parameters": {"binary_data_size": 8}}]}'


@pytest.mark.parametrize("body, header, message", [
    (b"{", None, "not valid JSON"),
    (b'{"inputs": 3}', None, "'inputs' list"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [1]}]}', None,
     "1 values for shape"),
    (_BINARY_HEAD + b"\x00\x00\x80?", str(len(_BINARY_HEAD)), "exceeds the body"),
    (b'{"inputs": [{"name": "a", "datatype": "FP9", "shape": [1], "data": [1]}]}', None,
     "unknown datatype"),
    (b'{"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": ["%%"]}]}', None,
     "base64"),
])
def test_protocol_refuses_malformed_requests(body, header, message):
    with pytest.raises(ProtocolError, match=message):
        parse_infer_request(body, header)


def test_protocol_encodes_binary_outputs_as_triton_expects():
    logits = np.ones((2, 3), dtype=np.float32)
    labels = np.array([[b"x"], [b"yz"]], dtype=object)
    body, headers = encode_infer_response(
        "m", "1", "7", [("logits", logits, True), ("labels", labels, True)]
    )
    n = int(headers[HEADER_LENGTH])
    head = json.loads(body[:n])
    assert head["id"] == "7" and [o["parameters"]["binary_data_size"] for o in head["outputs"]] \
        == [24, 11]
    assert body[n:] == logits.tobytes() + b"\x01\x00\x00\x00x\x02\x00\x00\x00yz"


# ----------------------------------------------------------------------------- server
def test_metadata_and_health(server):
    client = server.client
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(NAME)
    meta = client.get_model_metadata(NAME)
    assert {i["name"]: i["shape"] for i in meta["inputs"]} == {"pixel_values": [-1, 3, 32, 32]}
    assert "images" in client.get_model_config(NAME)["parameters"]  # the other way in
    assert [o["name"] for o in meta["outputs"]] == ["logits", "probabilities", "labels"]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def test_stream_matches_offline_runtime(server, pixels, raw_images):
    """Tensor and image requests, one step each: logits equal the offline runtime's on the same
    batches with the same seed; probabilities and top-k labels follow from them."""
    reset(server)
    reference = offline()
    labels = read_metadata(MODEL).labels
    bounds = [0, 8, 13, 29, 30, 46, 78]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        request = image_input(raw_images[lo:hi]) if i % 2 else tensor_input(pixels[lo:hi])
        outputs = [httpclient.InferRequestedOutput(n) for n in ("logits", "probabilities")]
        outputs.append(httpclient.InferRequestedOutput("labels", class_count=3))
        result = server.client.infer(NAME, [request], outputs=outputs)
        expected = reference.step(pixels[lo:hi])
        logits = result.as_numpy("logits")
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
        probabilities = result.as_numpy("probabilities")
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
        top = result.as_numpy("labels")
        assert top.shape == (hi - lo, 3)
        assert [t.decode() for t in top[:, 0]] == [labels[j] for j in expected.argmax(axis=1)]
    stats = statistics(server)
    assert stats["steps"] == len(bounds) - 1 and stats["forwards_per_sample"] == 2.0
    assert stats["drift"] == pytest.approx(
        float(np.linalg.norm(reference.state.theta - reference.metadata.theta0)), rel=1e-4
    )


def _concurrent(url: str, pixels: np.ndarray, clients: int = 16, requests: int = 20):
    """clients x requests, each request 1-3 distinct images; returns (row ids, logits) pairs."""
    def run(c: int):
        client = httpclient.InferenceServerClient(url)
        out = []
        try:
            for r in range(requests):
                start = (c * requests + r) * 2 % (len(pixels) - 3)
                rows = np.arange(start, start + 1 + (c + r) % 3)
                result = client.infer(NAME, [tensor_input(pixels[rows])])
                out.append((rows, result.as_numpy("logits")))
        finally:
            client.close()
        return out

    with ThreadPoolExecutor(clients) as pool:
        return [pair for part in pool.map(run, range(clients)) for pair in part]


def _coalesced_requests(server: ServerProcess) -> tuple[float, float]:
    status, body = http_call(server, "GET", "/metrics")
    text = body.decode()
    total = float(re.search(r"eva0_batch_requests_sum (\S+)", text).group(1))
    steps = float(re.search(r"eva0_batch_requests_count (\S+)", text).group(1))
    return total, steps


def test_concurrent_clients_get_their_own_rows(pixels, tmp_path):
    """16 clients x 20 requests of 1-3 distinct images. NoAdapt: every returned row equals the
    offline prediction of that very image. EVA-0 with eta 0 and mu 5e-4 (theta stays at theta0;
    each row is the mean of its +/- perturbed logits, within 0.02 of NoAdapt's, while any two
    of these images are >= 0.05 apart): requests coalesce into shared steps, and every row
    matches its own image."""
    expected = offline("noadapt").predict(pixels)
    quiet_eva0 = ["--method", "eva0", "--set", "eta=0", "--set", "mu=5e-4",
                  "--set", "activation_shift=0"]  # the rows are the model's own logits
    for args in (["--method", "noadapt"], quiet_eva0):
        server = ServerProcess(tmp_path / f"{args[1]}.log", *args, "--max-delay-ms", "20")
        try:
            pairs = _concurrent(server.url, pixels)
            total, steps = _coalesced_requests(server)
        finally:
            assert server.stop(), server.log()
        assert len(pairs) == 320 and total == 320 and steps < 320
        tolerance = 1e-4 if args[1] == "noadapt" else 0.02
        for rows, logits in pairs:
            np.testing.assert_allclose(logits, expected[rows], rtol=0, atol=tolerance)


def test_one_image_per_request_does_not_lose_to_noadapt(raw_images, pixels, tmp_path):
    """A server with its defaults, one client sending one clean image per request (each step
    a batch of 1): served accuracy on 400 images at least NoAdapt's - 0.5."""
    labels = load_fashion_mnist("test")[1][: len(raw_images)]
    count = 400
    reference = 100 * float((offline("noadapt").predict(pixels[:count]).argmax(1)
                             == labels[:count]).mean())
    server = ServerProcess(tmp_path / "single.log")
    try:
        hits = sum(
            int(server.client.infer(NAME, [tensor_input(pixels[i : i + 1])])
                .as_numpy("logits").argmax() == labels[i])
            for i in range(count)
        )
        stats = statistics(server)
    finally:
        assert server.stop(), server.log()
    assert stats["steps"] == count and stats["skipped_steps"] == 0
    assert 100 * hits / count >= reference - 0.5


def test_black_frames_then_clean_images_do_not_lose_to_noadapt(raw_images, pixels, tmp_path):
    """A camera facing a wall: 300 black frames, one per request, then 300 clean images one per
    request. The guard trips on the black frames (predictions go near-uniform) or audits the
change of stream, and served
    accuracy on the clean ones stays within 2 points of NoAdapt's (EVA-0 at batch 1 changes a
    few near-tie predictions either way: +-1 point on 300 images is noise here)."""
    labels = load_fashion_mnist("test")[1][: len(raw_images)]
    clean = slice(300, 600)
    reference = 100 * float((offline("noadapt").predict(pixels[clean]).argmax(1)
                             == labels[clean]).mean())
    black = preprocess_uint8(np.zeros((1, 32, 32, 3), np.uint8), read_metadata(MODEL).preprocessing)
    server = ServerProcess(tmp_path / "black.log")
    try:
        for _ in range(300):
            server.client.infer(NAME, [tensor_input(black)])
        hits = sum(
            int(server.client.infer(NAME, [tensor_input(pixels[i : i + 1])])
                .as_numpy("logits").argmax() == labels[i])
            for i in range(clean.start, clean.stop)
        )
        stats = statistics(server)
    finally:
        assert server.stop(), server.log()
    guard = stats["guard"]
    assert stats["skipped_steps"] == 0 and guard["trips"] + guard["audits"] >= 1
    assert 100 * hits / 300 >= reference - 2.0, stats["guard"]


def _infer_json(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _encoded(image: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt)
    return buf.getvalue()


def _images_json(encoded: list[bytes]) -> dict:
    return {"name": "images", "datatype": "BYTES", "shape": [len(encoded)],
            "data": [base64.b64encode(e).decode() for e in encoded]}


def _pixels_json(x: np.ndarray, datatype: str = "FP32", name: str = "pixel_values") -> dict:
    return {"name": name, "datatype": datatype, "shape": list(x.shape), "data": x.ravel().tolist()}


def test_bad_input_is_refused_and_never_touches_the_state(server, pixels):
    ok = pixels[:2]
    nan = ok.copy()
    nan[0, 0, 0, 0] = np.nan
    head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                   "shape": [2, 3, 32, 32],
                                   "parameters": {"binary_data_size": 100}}]}).encode()
    cases = [
        ("/v2/models/other/infer", _infer_json([_pixels_json(ok)]), {}, 404, "unknown model"),
        (INFER, b"{not json", {}, 400, "not valid JSON"),
        (INFER, _infer_json([_pixels_json(ok, name="x")]), {}, 400, "unknown input 'x'"),
        (INFER, _infer_json([_pixels_json(ok, "FP64")]), {}, 400, "must be FP32"),
        (INFER, _infer_json([_pixels_json(ok[:, :, :28, :28])]), {}, 400, "must have shape"),
        (INFER, _infer_json([_pixels_json(np.zeros((MAX_BATCH + 1, 3, 32, 32), np.float32))]),
         {}, 400, "exceeds the server's max batch"),
        (INFER, _infer_json([{"name": "images", "datatype": "BYTES", "shape": [1],
                              "data": ["bm90IGFuIGltYWdl"]}]), {}, 400, "not a decodable"),
        (INFER, _infer_json([_pixels_json(nan)]), {}, 400, "NaN"),
        (INFER, _infer_json([_pixels_json(ok * 0 + 200.0)]), {}, 400, "outside"),
        (INFER, head + b"\x00" * 100, {HEADER_LENGTH: str(len(head))}, 400,
         "100 bytes of binary data"),
        (INFER, _infer_json([_pixels_json(ok)], outputs=[{"name": "nope"}]), {}, 400,
         "unknown output"),
        (INFER, b"0" * (2 * 2**20), {}, 413, "exceeds the limit"),
        (INFER, _infer_json([_pixels_json(ok), _pixels_json(ok, name="images")]), {}, 400,
         "exactly one"),
        (INFER, b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": ['
         + b"9" * 5000 + b'], "data": [1]}]}', {}, 400, "not valid JSON"),
        (INFER, _infer_json([{"name": "pixel_values", "datatype": "INT8", "shape": [1],
                              "data": [300]}]), {}, 400, "does not fit INT8"),
        (INFER, _infer_json([{**_pixels_json(ok), "parameters": [1]}]), {}, 400,
         "'parameters' must be a JSON object"),
        (INFER, _infer_json([_pixels_json(ok)], parameters=[]), {}, 400,
         "'parameters' must be a JSON object"),
        (INFER, b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, "not valid JSON"),
        (f"/v2/models/{NAME}/versions/7/infer", _infer_json([_pixels_json(ok)]), {}, 404,
         "unknown version"),
        (INFER, _infer_json([_images_json([_encoded(np.zeros((8, 8), np.uint8), "GIF")])]),
         {}, 400, "not a decodable PNG/JPEG"),
        (INFER, _infer_json([_images_json([_encoded(np.zeros((6000, 6000), np.uint8))])]),
         {}, 413, "over the server's budget"),
    ]
    before = statistics(server)
    for path, body, headers, status, message in cases:
        got, answer = http_call(server, "POST", path, body, headers)
        assert got == status, (message, answer)
        assert message in json.loads(answer)["error"], answer
    after = statistics(server)
    assert after["steps"] == before["steps"] and after["drift"] == before["drift"]
    assert server.client.is_server_ready()
    for path in ("/docs", "/openapi.json", f"/v2/models/{NAME}/versions/2"):
        assert http_call(server, "GET", path)[0] == 404
    with pytest.raises(Exception, match="exceeds the server's max batch"):
        server.client.infer(NAME, [tensor_input(np.zeros((MAX_BATCH + 1, 3, 32, 32), "f4"))])


def test_state_snapshot_get_put_and_reset(server, pixels):
    reset(server)
    server.client.infer(NAME, [tensor_input(pixels[:16])])
    status, snapshot = http_call(server, "GET", f"/v2/models/{NAME}/adaptation/state")
    assert status == 200
    state, _ = decode_state(snapshot)
    assert state.step == 1
    server.client.infer(NAME, [tensor_input(pixels[16:32])])
    assert statistics(server)["steps"] == 2
    broken = snapshot[:-20]
    status, body = http_call(server, "PUT", f"/v2/models/{NAME}/adaptation/state", broken)
    assert status == 400 and "state refused" in json.loads(body)["error"]
    assert statistics(server)["steps"] == 2
    status, body = http_call(server, "PUT", f"/v2/models/{NAME}/adaptation/state", snapshot)
    assert status == 200 and json.loads(body)["steps"] == 1
    fingerprint = Policy.load(MODEL, "noadapt", provider="cpu").fingerprint
    nan_state = state.copy()
    nan_state.theta[:] = np.nan
    text_step = state.copy()
    text_step.step = "abc"
    for forged in (nan_state, text_step):  # re-signed: checksum and fingerprint are valid
        status, body = http_call(server, "PUT", f"/v2/models/{NAME}/adaptation/state",
                                 encode_state(forged, fingerprint, {}))
        assert status == 400 and "state refused" in json.loads(body)["error"]
    assert statistics(server)["steps"] == 1
    reset(server)
    stats = statistics(server)
    assert stats["steps"] == 0 and stats["drift"] == 0.0


def test_admin_endpoints_need_the_token_or_loopback(tmp_path, pixels):
    """Off loopback without a token: 403 (the app as a non-loopback bind configures it, served
    on loopback); with a token: 401 without or with a wrong one, 200 with the right one;
    inference stays open throughout."""
    reset_path = f"/v2/models/{NAME}/adaptation/reset"
    model = Policy.load(MODEL, "eva0", seed=0, provider="cpu", threads=1)
    open_bind = InProcessServer(create_app(model, ServeOptions(NAME, loopback=False)))
    try:
        assert http_call(open_bind, "POST", reset_path)[0] == 403
        status, state = http_call(open_bind, "GET", f"/v2/models/{NAME}/adaptation/state")
        assert status == 403
        assert http_call(open_bind, "PUT", f"/v2/models/{NAME}/adaptation/state",
                         model.state_bytes())[0] == 403
        status, body = http_call(open_bind, "POST", INFER, _infer_json([_pixels_json(pixels[:2])]))
        assert status == 200, body
    finally:
        open_bind.stop()
    guarded = ServerProcess(tmp_path / "token.log", "--admin-token", "s3cret")
    try:
        assert http_call(guarded, "POST", reset_path)[0] == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http_call(guarded, "POST", reset_path, headers=wrong)[0] == 401
        right = {"Authorization": "Bearer s3cret"}
        status, body = http_call(guarded, "POST", reset_path, headers=right)
        assert status == 200 and json.loads(body)["steps"] == 0
        guarded.client.infer(NAME, [tensor_input(pixels[:2])])
    finally:
        assert guarded.stop(), guarded.log()


def test_metrics_are_exposed(server, pixels):
    server.client.infer(NAME, [tensor_input(pixels[:4])])
    status, body = http_call(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    for name in ("eva0_requests_total", "eva0_request_latency_seconds_bucket",
                 "eva0_batch_rows_bucket", "eva0_adaptation_steps_total", "eva0_theta_drift",
                 "eva0_guard_trips", "eva0_guard_audits", "eva0_guard_theta0_verdicts"):
        assert name in text
    assert re.search(r'eva0_requests_total\{status="400"\} [1-9]', text)


def test_sigkill_resumes_from_the_last_good_snapshot(tmp_path, pixels):
    state_dir = tmp_path / "state"
    batches = [pixels[8 * i : 8 * i + 8] for i in range(13)]
    first = ServerProcess(tmp_path / "a.log", "--state-dir", str(state_dir),
                          "--snapshot-every", "5")
    for x in batches[:12]:
        first.client.infer(NAME, [tensor_input(x)])
    first.kill()
    assert len(list(state_dir.glob("snapshot-*.npz"))) == 2  # steps 5 and 10

    reference = offline()
    for x in batches[:10]:
        reference.step(x)
    second = ServerProcess(tmp_path / "b.log", "--state-dir", str(state_dir))
    try:
        assert statistics(second)["steps"] == 10
        status, snapshot = http_call(second, "GET", f"/v2/models/{NAME}/adaptation/state")
        np.testing.assert_allclose(decode_state(snapshot)[0].theta, reference.state.theta,
                                   atol=1e-6)
        logits = second.client.infer(NAME, [tensor_input(batches[10])]).as_numpy("logits")
        np.testing.assert_allclose(logits, reference.step(batches[10]), rtol=1e-4, atol=1e-4)
    finally:
        assert second.stop(), second.log()  # graceful: a final snapshot at step 11

    newest = max(state_dir.glob("snapshot-*.npz"))
    (state_dir / "snapshot-99999999.npz").write_bytes(newest.read_bytes()[:-50])
    third = ServerProcess(tmp_path / "c.log", "--state-dir", str(state_dir))
    try:
        assert statistics(third)["steps"] == 11
        assert "snapshot refused" in third.log()
    finally:
        third.stop()


def test_slow_headers_get_408_and_their_connection_closed(server):
    """A client that never finishes its request headers is cut off (--header-timeout-s 2)
    while the others are served."""
    import socket

    host, port = server.url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert server.client.is_server_ready()
        answer = b""
        while chunk := slow.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert server.client.is_server_live()


def test_foa_is_served_with_its_state_refused(prompt_vit, tmp_path):
    """`serve --method foa@5` on a prompt model: tritonclient inference, statistics, freeze;
    its CMA-ES state is not persisted, so GET state answers 409."""
    name = prompt_vit.onnx_path.stem
    server = ServerProcess(tmp_path / "foa.log", "--method", "foa@5", model=prompt_vit.onnx_path)
    try:
        x = np.random.default_rng(0).uniform(-1, 1, (3, 3, 32, 32)).astype(np.float32)
        for _ in range(2):
            logits = server.client.infer(name, [tensor_input(x)]).as_numpy("logits")
            assert logits.shape == (3, 10) and np.isfinite(logits).all()
        status, body = http_call(server, "GET", f"/v2/models/{name}/adaptation/statistics")
        stats = json.loads(body)
        assert status == 200 and stats["method"] == "foa" and stats["steps"] == 2
        assert stats["forwards_per_sample"] == 5
        status, body = http_call(server, "GET", f"/v2/models/{name}/adaptation/state")
        assert status == 409 and "not persisted" in json.loads(body)["error"]
        status, body = http_call(server, "POST", f"/v2/models/{name}/adaptation/freeze",
                                 json.dumps({"frozen": True}).encode(),
                                 {"Content-Type": "application/json"})
        assert status == 200 and json.loads(body)["frozen"] is True
        server.client.infer(name, [tensor_input(x)])
        status, body = http_call(server, "GET", f"/v2/models/{name}/adaptation/statistics")
        assert json.loads(body)["steps"] == 2  # frozen: predicted, not searched
    finally:
        assert server.stop(), server.log()
