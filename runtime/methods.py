"""One way to open any runtime method (see :mod:`.registry` for the table) on a model file.

Names take an optional ``@FP`` suffix, the forward passes per sample (#FP): ``eva0-clubs@8``,
``foa-dagger@14``. The prompt methods (``eva0-clubs``, ``foa``, ``foa-dagger``) need a model
exported in black-box prompt mode (``eva0-edge export --prompts T``).
"""

from __future__ import annotations

import os
from typing import Any

from .policy import Policy
from .registry import RUNTIME_KINDS, method_names, spec_of
from .session import SessionSettings

RUNTIME_METHODS = method_names(*RUNTIME_KINDS)
PROMPT_METHODS = method_names(*RUNTIME_KINDS, prompt_model=True)


def base_name(name: str) -> str:
    """The runtime method without its ``@FP`` suffix; ValueError for an unknown method."""
    return spec_of(name, *RUNTIME_KINDS).name


def is_prompt_method(name: str) -> bool:
    """Whether ``name`` adapts input prompts (and so needs a prompt model)."""
    return spec_of(name, *RUNTIME_KINDS).prompt_model


def load_method(
    path: str | os.PathLike,
    name: str,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    session: SessionSettings | None = None,
) -> Policy:
    """Open ``path`` with ONNX Runtime under method ``name`` (any runtime method, ``@FP``
    allowed): the :class:`~eva0_edge.runtime.policy.Policy` that owns the method's model.
    ``config`` overrides the method's hyper-parameters; ``session``: how ORT runs it (default
    :class:`~eva0_edge.runtime.session.SessionSettings`'s)."""
    return Policy.load(path, name, config, seed, **(session or SessionSettings()).keywords())
