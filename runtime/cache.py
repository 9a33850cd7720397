"""Where generated data lives: ``$EVA0_CACHE``, else ``$XDG_CACHE_HOME/eva0-edge``, else
``~/.cache/eva0-edge``. Never inside the git tree's tracked files."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    if "EVA0_CACHE" in os.environ:
        return Path(os.environ["EVA0_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eva0-edge"


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes: the cache key of what is derived from a model file."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
