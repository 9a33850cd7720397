"""``eva0-edge serve``: an Open Inference Protocol (KServe v2) HTTP server that adapts online.
"""

from .app import ServeOptions, create_app
from .runner import run_server

__all__ = ["ServeOptions", "create_app", "run_server"]
