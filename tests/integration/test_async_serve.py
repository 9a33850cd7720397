"""The asynchronous server (``serve --async-adapt``): answers from one forward at the current
theta, adaptation on answered inputs while the worker is idle, within the budget."""

from __future__ import annotations

import json

import pytest
import tritonclient.http as httpclient

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.server.worker import AdaptationWorker
from tests.component.test_async_serve import MODEL, images, wait_for
from tests.fixtures import ServerProcess, http_call


def test_a_method_without_a_separate_step_is_refused(prompt_vit):
    model = Policy.load(prompt_vit.onnx_path, "foa@4", provider="cpu")
    with pytest.raises(ValueError, match="asynchronous adaptation"):
        AdaptationWorker(model, 8, 0.0, asynchronous=True)


def test_the_server_reports_served_adapted_and_dropped(tmp_path):
    """``serve --async-adapt`` through a real HTTP client: the answer, then the statistics'
    counts once the idle pass has run."""
    server = ServerProcess(tmp_path / "async.log", "--async-adapt", "--max-batch", "4",
                           model=MODEL)
    try:
        x = images(4, 0)
        tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        assert server.client.infer("vit_fmnist", [tensor]).as_numpy("logits").shape == (4, 10)

        def counts() -> dict:
            status, body = http_call(server, "GET", "/v2/models/vit_fmnist/adaptation/statistics")
            assert status == 200
            return json.loads(body)["asynchronous"]

        wait_for(lambda: counts()["adapted_samples"] == 4)
        assert counts() == {"served_samples": 4, "adapted_samples": 4, "dropped_samples": 0,
                            "adapting_samples": 0, "waiting_samples": 0}
    finally:
        server.stop()
