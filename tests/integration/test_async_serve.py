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


def test_sigterm_under_cpu_load_ends_the_server_with_its_snapshot(tmp_path):
    """Two CPU-bound processes beside an asynchronous server (issue 50 item 7): SIGTERM with a
    pass begun ends the process gracefully (its lifespan ran to the end) and the snapshot of
    the last applied step is written after the signal and loads. How long the exit takes is
    measured in ``studies/serve-shutdown/``, not asserted here."""
    import signal
    import subprocess
    import sys
    import time

    from eva0_edge.runtime.state import read_state_file

    state_dir = tmp_path / "state"
    server = ServerProcess(tmp_path / "async.log", "--async-adapt", "--max-batch", "4",
                           "--state-dir", str(state_dir), model=MODEL)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for seed in range(3):
            x = images(4, seed)
            tensor = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            server.client.infer("vit_fmnist", [tensor])
        signalled = time.time()
        server.process.send_signal(signal.SIGTERM)
        assert server.stop(), server.log()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    newest = max(state_dir.glob("snapshot-*.npz"))
    assert newest.stat().st_mtime >= signalled
    _, info = read_state_file(newest)
    assert info["method"] == "eva0" and info["asynchronous"] is True
