"""Where generated data lives: ``$EVA0_CACHE``, else ``$XDG_CACHE_HOME/eva0-edge``, else
``~/.cache/eva0-edge``. Never inside the git tree's tracked files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if "EVA0_CACHE" in os.environ:
        return Path(os.environ["EVA0_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eva0-edge"
