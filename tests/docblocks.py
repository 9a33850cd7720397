"""Running a documentation page's shell blocks as written: a real ``eva0-edge serve`` process
started in the background when a block starts one, and stopped at the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``text``, in order."""
    return re.findall(r"^```(\w+)\n(.*?)^```$", text, flags=re.S | re.M)


def wait_ready(port: int, server: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until the server on 127.0.0.1:``port`` answers ``/v2/health/ready``; AssertionError
    with its log when it exits or takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the server was not ready after {timeout} s: {log.read_text()[-3000:]}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the shell and the server it started (their own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def run_block(
    command: list[str], code: str, cwd: Path, env: dict[str, str], port: int, log: Path,
    timeout: float = 600,
) -> subprocess.Popen | subprocess.CompletedProcess:
    """Run one block's ``command``: a block that starts ``eva0-edge serve`` in the background
    (its output to ``log``) until the server on ``port`` is ready, returning the process;
    any other to its end, asserting it succeeded, returning what it printed."""
    if "eva0-edge serve" in code:
        with open(log, "wb") as sink:
            server = subprocess.Popen(command, cwd=cwd, env=env, stdout=sink,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready(port, server, log)
        return server
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done
