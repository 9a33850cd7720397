"""A study script (``studies/<question>/<name>.py``: run by path, not a package module) loaded
for its test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def load_study(folder: str, name: str) -> ModuleType:
    """``studies/<folder>/<name>.py`` as a module (registered, so its dataclasses resolve)."""
    key = f"eva0_edge_study_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, STUDIES / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
