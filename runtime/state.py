"""The adaptation state and its file format.

A state file is an ``.npz`` holding every array of :class:`AdaptState` plus ``__meta__`` (JSON:
scalars, the model fingerprint, and a SHA-256 over all arrays). It is written atomically; a
truncated or tampered file fails the checksum and is refused with :class:`StateError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write_bytes

STATE_VERSION = 1
_ARRAY_FIELDS = ("theta", "anchor", "center", "mean", "second_moment", "velocity")


class StateError(ValueError):
    """A state file or dict is corrupt, or belongs to another model."""


@dataclass
class AdaptState:
    """Everything that evolves while adapting. theta, anchor, velocity: [P]; center: [K];
    mean, second_moment: [F] (EMA of h and h^2); arrays are float32 (float64 for EMAs)."""

    theta: np.ndarray
    anchor: np.ndarray
    center: np.ndarray
    mean: np.ndarray
    second_moment: np.ndarray
    velocity: np.ndarray
    moments_ready: bool = False
    balance_in: float = 0.0
    balance_out: float = 0.0
    anchor_credit: float = 0.0
    step: int = 0
    skipped: int = 0
    seed: int = 0

    @classmethod
    def initial(cls, theta0: np.ndarray, num_classes: int, num_features: int, seed: int):
        theta0 = np.asarray(theta0, dtype=np.float32)
        return cls(
            theta=theta0.copy(),
            anchor=theta0.copy(),
            center=np.zeros(num_classes, dtype=np.float64),
            mean=np.zeros(num_features, dtype=np.float64),
            second_moment=np.zeros(num_features, dtype=np.float64),
            velocity=np.zeros_like(theta0),
            seed=seed,
        )

    def copy(self) -> AdaptState:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _ARRAY_FIELDS:
            values[name] = values[name].copy()
        return AdaptState(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of copies (arrays and scalars)."""
        return {f.name: getattr(self.copy(), f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AdaptState:
        names = {f.name for f in fields(cls)}
        missing = sorted(set(names) - set(values))
        if missing:
            raise StateError(f"state lacks {missing}")
        kwargs = {k: v for k, v in values.items() if k in names}
        for name in _ARRAY_FIELDS:
            kwargs[name] = np.array(kwargs[name], copy=True)
        return cls(**kwargs)


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def encode_state(state: AdaptState, fingerprint: str, info: dict[str, Any]) -> bytes:
    """Serialise ``state`` (+ model fingerprint and free-form ``info``) to npz bytes."""
    arrays = {name: getattr(state, name) for name in _ARRAY_FIELDS}
    scalars = {
        f.name: getattr(state, f.name) for f in fields(state) if f.name not in _ARRAY_FIELDS
    }
    meta = {
        "version": STATE_VERSION,
        "fingerprint": fingerprint,
        "scalars": scalars,
        "info": info,
        "sha256": _digest(arrays),
    }
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)), **arrays)
    return buf.getvalue()


def decode_state(data: bytes, fingerprint: str | None = None) -> tuple[AdaptState, dict]:
    """Parse npz bytes; verify checksum and (if given) the model fingerprint."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["__meta__"]))
            arrays = {name: npz[name] for name in _ARRAY_FIELDS}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as err:
        raise StateError(f"unreadable state (truncated or not a state file): {err}") from err
    if meta.get("version", 0) > STATE_VERSION:
        raise StateError(f"state version {meta['version']} is newer than this runtime")
    if _digest(arrays) != meta.get("sha256"):
        raise StateError("state checksum mismatch: the file is corrupt or was modified")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise StateError("state belongs to another model (fingerprint mismatch)")
    state = AdaptState.from_dict({**arrays, **meta["scalars"]})
    return state, meta.get("info", {})


def write_state_file(path: str | os.PathLike, data: bytes) -> Path:
    """Atomically write encoded state bytes."""
    return atomic_write_bytes(path, data)


def read_state_file(path: str | os.PathLike, fingerprint: str | None = None):
    """Read and verify a state file; returns (AdaptState, info)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"state file not found: {path}")
    try:
        return decode_state(path.read_bytes(), fingerprint)
    except StateError as err:
        raise StateError(f"{path}: {err}") from err
