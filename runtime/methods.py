"""Every runtime method by name, and one way to open any of them on a model file.

Names take an optional ``@FP`` suffix, the forward passes per sample (#FP): ``eva0-clubs@8``,
``foa-dagger@14``. The prompt methods (``eva0-clubs``, ``foa``, ``foa-dagger``) need a model
exported in black-box prompt mode (``eva0-edge export --prompts T``).
"""

from __future__ import annotations

import os
from typing import Any

from .engine import METHODS, PROMPT_ONLY, AdaptiveModel, parse_method
from .foa import FOA_METHODS, FOAModel

RUNTIME_METHODS = (*sorted(METHODS), *sorted(FOA_METHODS))
PROMPT_METHODS = (*PROMPT_ONLY, *sorted(FOA_METHODS))


def base_name(name: str) -> str:
    """The method without its ``@FP`` suffix; ValueError for an unknown method."""
    base, _ = parse_method(name)
    if base not in RUNTIME_METHODS:
        raise ValueError(f"unknown method {name!r}; runtime methods: {', '.join(RUNTIME_METHODS)}")
    return base


def is_prompt_method(name: str) -> bool:
    """Whether ``name`` adapts input prompts (and so needs a prompt model)."""
    return base_name(name) in PROMPT_METHODS


def load_method(
    path: str | os.PathLike,
    name: str,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    provider: str = "auto",
    threads: int | None = None,
    low_memory: bool = False,
    io_binding: bool = False,
) -> AdaptiveModel | FOAModel:
    """Open ``path`` with ONNX Runtime under method ``name`` (any runtime method, ``@FP``
    allowed); ``config`` overrides the method's hyper-parameters; ``low_memory`` and
    ``io_binding``: see :class:`~eva0_edge.runtime.session.AdaptableSession`."""
    model_cls = FOAModel if base_name(name) in FOA_METHODS else AdaptiveModel
    return model_cls.load(path, name, config, seed, provider, threads, low_memory, io_binding)
