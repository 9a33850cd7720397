"""``eva0-edge serve``: an Open Inference Protocol (KServe v2) HTTP server that adapts online.

The application (FastAPI) is imported on first use, so :mod:`.options` is read without it.
"""

from __future__ import annotations

from typing import Any

from .options import ServeOptions

__all__ = ["ServeOptions", "create_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "run_server":
        from .runner import run_server

        return run_server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
