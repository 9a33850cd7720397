"""The test session writes what it generates to a cache of its own (tests/conftest.py), never
to the user's: ``make test`` left 764 MB in ``~/.cache/eva0-edge`` before it did."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from eva0_edge.runtime.cache import cache_dir


def test_the_session_cache_is_a_temporary_folder_of_its_own():
    if os.environ.get("EVA0_TEST_CACHE"):  # a kept cache the developer named
        assert cache_dir() == Path(os.environ["EVA0_TEST_CACHE"])
        return
    cache = cache_dir()
    assert cache.parent == Path(tempfile.gettempdir())
    assert cache.name.startswith("eva0-test-cache-")
    assert cache != Path.home() / ".cache" / "eva0-edge"
