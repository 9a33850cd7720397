"""What Triton's own clients ask before their first request, answered through tritonclient: the
model configuration, the repository index and inference statistics (their counts equal the
requests made, and they say where their time went), metadata whose inputs can all be sent
together, and the protocol's ``{"error": ...}`` body on every route, unrouted paths and methods
included (issue 50 item 4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server import ServeOptions, create_app
from tests.fixtures import SHIPPED_RESNET_GN, InProcessServer, http_call, uniform_batch

NAME = "m"


@pytest.fixture(scope="module")
def server():
    model = Policy.load(SHIPPED_RESNET_GN, "eva0", seed=0, provider="cpu", threads=1)
    running = InProcessServer(create_app(model, ServeOptions(NAME, max_batch=16)))
    running.client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
    yield running
    running.stop()


def _request(x: np.ndarray) -> list:
    tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return [tensor]


def test_a_client_builds_a_request_from_the_metadata_and_the_config(server):
    client = server.client
    config = client.get_model_config(NAME)
    assert config["name"] == NAME and config["max_batch_size"] == 16
    metadata = client.get_model_metadata(NAME)  # the same inputs: a client sends them all
    assert [i["name"] for i in metadata["inputs"]] == [i["name"] for i in config["input"]]
    assert "images" in config["parameters"]
    inputs = []
    for spec in metadata["inputs"]:  # every listed input, as a generic client sends them
        shape = [2 if d == -1 else d for d in spec["shape"]]
        x = uniform_batch(2)[: shape[0]].astype(np.float32)
        assert list(x.shape) == shape and spec["datatype"] == "FP32"
        inputs += _request(x)
    assert client.infer(NAME, inputs).as_numpy("logits").shape == (2, 10)
    assert {"model_configuration", "model_repository", "statistics"} <= set(
        client.get_server_metadata()["extensions"])


def test_the_repository_index_lists_the_model_ready(server):
    assert server.client.get_model_repository_index() == [
        {"name": NAME, "version": "1", "state": "READY"}]
    with pytest.raises(InferenceServerException, match="loads or unloads none"):
        server.client.load_model(NAME)


def test_statistics_count_the_requests_answered(server):
    def counts() -> tuple[int, int, int]:
        stats = server.client.get_inference_statistics(NAME)["model_stats"][0]
        success = stats["inference_stats"]["success"]["count"]
        return success, stats["inference_count"], stats["inference_stats"]["fail"]["count"]

    before = counts()
    for size in (1, 3, 4):
        server.client.infer(NAME, _request(uniform_batch(size)))
    with pytest.raises(InferenceServerException):
        server.client.infer(NAME, _request(uniform_batch(2) * 1e6))  # out of range: refused
    after = counts()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (3, 8, 1)
    every = server.client.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == [NAME]


def test_statistics_say_where_each_request_spent_its_time(server):
    """Every successful request counts once in the queue and compute parts (perf_analyzer finds
    the model's version by the queue count that grew), each part's time is spent, and the
    parts, disjoint spans of each request, add up to no more than the requests' own time."""
    parts = ("compute_input", "queue", "compute_infer", "compute_output")

    def read() -> dict:
        return server.client.get_inference_statistics(NAME)["model_stats"][0]["inference_stats"]

    before = read()
    for size in (1, 2, 4):
        server.client.infer(NAME, _request(uniform_batch(size)))
    after = read()
    grown = {key: {unit: after[key][unit] - before[key][unit] for unit in ("count", "ns")}
             for key in ("success", *parts)}
    assert [grown[part]["count"] for part in parts] == [3, 3, 3, 3]
    assert all(grown[part]["ns"] > 0 for part in parts), grown
    assert sum(grown[part]["ns"] for part in parts) <= grown["success"]["ns"], grown


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v2/no/such/route", 404),
    ("DELETE", "/v2/models/m/infer", 405),
    ("GET", "/v2/models/other/config", 404),
    ("GET", "/v2/models/other/stats", 404),
    ("POST", "/v2/models/m/config", 405),
])
def test_every_error_is_the_protocols_body(server, method, path, status):
    got, body = http_call(server, method, path)
    assert got == status
    answer = json.loads(body)
    assert set(answer) == {"error"} and answer["error"]
