"""Staged by ``tools/mutate.py`` as the mutation run's root ``conftest.py``: the tests that
reach a mutant run fastest first (mutmut hands them over as an unordered set and stops at the
first failure, so a mutant a 10 ms test kills no longer waits for a 5 s one to finish first)."""

from __future__ import annotations

import json
from pathlib import Path

STATS = Path("mutmut-stats.json")


def pytest_collection_modifyitems(config, items) -> None:
    if not STATS.exists():
        return
    seconds = json.loads(STATS.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: seconds.get(item.nodeid, 0.0))
