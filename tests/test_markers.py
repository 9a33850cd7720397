"""The tiers' markers come from what a test uses: the fast tier (`make test-fast`) passes with
no Fashion-MNIST on the machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_the_fast_tier_needs_no_dataset(tmp_path):
    env = {**os.environ, "EVA0_FMNIST_ROOT": str(tmp_path / "no-dataset-here")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow and not integration",
         "-p", "no:cacheprovider"],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:]
