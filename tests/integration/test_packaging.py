"""The distribution as a user installs it: ``pip install .`` (not editable) maps the top-level
folders into ``eva0_edge.*``, ``python -m eva0_edge`` is the command, and the wheel ships the
product only: no studies, no results, no recipes, no tests."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # builds the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True,
                   timeout=600)
    (built,) = out.glob("eva0_edge-*.whl")
    return built


def test_the_wheel_holds_the_product_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert {"eva0_edge/__main__.py", "eva0_edge/runtime/policy.py",
            "eva0_edge/runtime/server/app.py", "eva0_edge/exporter/export.py",
            "eva0_edge/quant/qdq.py", "eva0_edge/bench/cli.py",
            "eva0_edge/fleet/app.py"} <= modules
    server = "eva0_edge/runtime/server/"
    assert {server + "dashboard/index.html", server + "dashboard/dashboard.js",
            server + "dashboard/dashboard.css", server + "static/uPlot.iife.min.js",
            server + "static/uPlot.min.css", server + "static/uPlot.LICENSE"} <= set(names), \
        "the dashboard's page and uPlot (make setup copies it) are package data"
    top = {n.split("/")[0] for n in names}
    assert top <= {"eva0_edge", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                   + ".dist-info"}, top
    shipped_elsewhere = [n for n in names if any(
        part in ("studies", "results", "recipes", "tests", "models") for part in n.split("/"))]
    assert shipped_elsewhere == []
    assert not [n for n in names if n.endswith((".diff", ".onnx", ".pth"))]


def test_an_installed_wheel_runs_as_python_m_eva0_edge(wheel, tmp_path):
    """Installed into a plain folder (no editable link tree), the command and the runtime
    import from the installed files."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import sys, eva0_edge.runtime.policy as p; "
            f"assert p.__file__.startswith({str(target)!r}), p.__file__; "
            "sys.argv = ['eva0_edge', 'info', sys.argv[1]]; "
            "import runpy; runpy.run_module('eva0_edge', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code,
                           str(ROOT / "models" / "resnet_gn_fmnist.onnx")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resnet_gn_fmnist" in done.stdout
