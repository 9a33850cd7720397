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

STATE_VERSION = 2
_ARRAY_FIELDS = ("theta", "anchor", "center", "mean", "second_moment", "velocity")


class StateError(ValueError):
    """A state file or dict is corrupt, or belongs to another model."""


@dataclass
class AdaptState:
    """Everything that evolves while adapting. theta, anchor, velocity: [P]; center: [K];
    mean, second_moment: [F] (windowed means of h and h^2); arrays are float32 (float64 for the
    statistics).

    stat_weight: total weight 1 - a^n of the n samples in center / mean / second_moment (0 =
    none yet; see :func:`rates.windowed_update`). coef_scale, coef_weight: the running scale of
    the SPSA coefficients and its weight. clipped_coefs, clipped_steps: counts of clipped
    coefficients and of steps cut to the trust radius.
    """

    theta: np.ndarray
    anchor: np.ndarray
    center: np.ndarray
    mean: np.ndarray
    second_moment: np.ndarray
    velocity: np.ndarray
    stat_weight: float = 0.0
    coef_scale: float = 0.0
    coef_weight: float = 0.0
    clipped_coefs: int = 0
    clipped_steps: int = 0
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

    @property
    def moments_ready(self) -> bool:
        """Whether the centre and moments hold any sample yet."""
        return self.stat_weight > 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AdaptState:
        """Build a state from arrays and scalars. Version-1 states (``moments_ready`` instead of
        ``stat_weight``, no coefficient scale) load: full statistics weigh 1, the scale starts
        empty."""
        values = dict(values)
        if "moments_ready" in values and "stat_weight" not in values:
            values["stat_weight"] = 1.0 if values.pop("moments_ready") else 0.0
        names = {f.name for f in fields(cls)}
        optional = {"stat_weight", "coef_scale", "coef_weight", "clipped_coefs", "clipped_steps"}
        missing = sorted(set(names) - optional - set(values))
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
