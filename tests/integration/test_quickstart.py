"""The README's quick start runs as written: its shell and Python blocks, in order, against the
shipped model, with a real ``eva0-edge serve`` process on 127.0.0.1.

The blocks run in a scratch folder that holds what the checkout gives them (``models/`` and
``.venv/``, as links), so the files they write (an exported model, ``item.png``) stay out of
the repository. The only change made to them is the port: the README's 8000 becomes a free
one, so the test never collides with a server already running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docblocks import fenced_blocks, run_block, stop
from tests.fixtures import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PORT = "8000"
LABELS = ("t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
          "bag", "ankle boot")


def quick_start_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block between the README's quick-start markers."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"\[start:quickstart\][^\n]*\n(.*?)\n[^\n]*\[end:quickstart\]", readme, re.S)
    assert match, "the README has no quick-start section"
    return fenced_blocks(match[1])


def test_the_quick_start_is_marked_and_uses_loopback():
    blocks = quick_start_blocks()
    languages = [language for language, _ in blocks]
    assert languages.count("python") == 1 and languages.count("bash") >= 4
    assert blocks[0] == ("bash", "source .venv/bin/activate\n")
    serve = [code for _, code in blocks if "eva0-edge serve" in code]
    assert len(serve) == 1 and "--host 127.0.0.1" in serve[0] and f"--port {PORT}" in serve[0]
    for _, code in blocks[1:]:
        if "127.0.0.1" in code or "--port" in code:
            assert PORT in code


def test_the_quick_start_runs_as_pasted(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").exists() or not (venv / "bin" / "eva0-edge").exists():
        pytest.skip("the quick start needs the tests to run in a venv with eva0-edge installed")
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / ".venv").symlink_to(venv)
    port = str(free_port())
    blocks = [(language, re.sub(rf"\b{PORT}\b", port, code))
              for language, code in quick_start_blocks()]
    (_, activate), rest = blocks[0], blocks[1:]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    server = None
    log = tmp_path / "serve.log"
    outputs = []
    try:
        for language, code in rest:
            if language == "python":
                (tmp_path / "snippet.py").write_text(code)
                command = ["bash", "-c", f"{activate}python snippet.py"]
            else:
                command = ["bash", "-ec", activate + code]
            done = run_block(command, code, tmp_path, env, int(port), log)
            if isinstance(done, subprocess.Popen):
                server = done
                continue
            outputs.append((language, code, done.stdout))
    finally:
        if server is not None:
            stop(server)
    assert server is not None, "the quick start starts no server"
    assert (tmp_path / "my_model.onnx").exists() and (tmp_path / "item.png").exists()
    (python_out,) = [out for language, _, out in outputs if language == "python"]
    assert any(f"b'{label}'" in python_out for label in LABELS), python_out
    (curl_out,) = [out for _, code, out in outputs if code.lstrip().startswith("curl")]
    answer = json.loads(curl_out)
    (labels,) = [o for o in answer["outputs"] if o["name"] == "labels"]
    assert labels["shape"] == [1, 3] and set(labels["data"]) <= set(LABELS)
    assert "stopped at step" in log.read_text()  # served the requests, then shut down cleanly
