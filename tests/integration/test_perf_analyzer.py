"""Triton's own load generator, perf_analyzer, runs unmodified against ``eva0-edge serve``
(issue 50 item 4): every request answered 200, and the server's statistics count what it sent.

perf_analyzer comes from tools/perf_analyzer.sh (``make perf-analyzer``; on glibc older than 2.38
through Debian 13's loader): the test fails, not skips, when it is missing."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.fixtures import MODEL, NAME, ROOT, ServerProcess, http_call

TOOL = ROOT / ".cache" / "perf-analyzer" / "perf_analyzer"


def _real_data(path: Path, count: int = 64) -> Path:
    """The first ``count`` test images in perf_analyzer's JSON input-data format (batch 1)."""
    images, _ = load_fashion_mnist("test")
    x = preprocess_uint8(images[:count], read_metadata(MODEL).preprocessing)
    rows = [{"pixel_values": {"content": row.ravel().tolist(), "shape": list(row.shape)}}
            for row in x]
    path.write_text(json.dumps({"data": rows}))
    return path


def test_perf_analyzer_runs_unmodified_and_the_server_counts_what_it_sent(tmp_path):
    assert TOOL.is_file(), f"{TOOL} is missing: make perf-analyzer"
    data = _real_data(tmp_path / "real.json")
    server = ServerProcess(tmp_path / "server.log", "--max-delay-ms", "5")
    try:
        run = subprocess.run(
            [str(TOOL), "-m", NAME, "-u", server.url, "-i", "http",
             "--concurrency-range", "1:4:3", "-p", "1500", "--max-trials", "4", "-s", "50",
             "--input-data", str(data), "-f", str(tmp_path / "out.csv")],
            capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        client = [int(n) for n in re.findall(r"Client: \n\s+Request count: (\d+)", run.stdout)]
        server_side = [int(n) for n in re.findall(r"Successful request count: (\d+)", run.stdout)]
        assert len(client) == len(server_side) == 2 and min(client) > 0
        for sent, counted, concurrency in zip(client, server_side, (1, 4), strict=True):
            assert abs(sent - counted) <= concurrency  # requests in flight at a window's edges
        status, body = http_call(server, "GET", f"/v2/models/{NAME}/stats")
        stats = json.loads(body)["model_stats"][0]["inference_stats"]
        assert status == 200 and stats["fail"]["count"] == 0
        assert stats["success"]["count"] >= sum(client)
        assert len((tmp_path / "out.csv").read_text().strip().splitlines()) == 3
    finally:
        server.stop()
