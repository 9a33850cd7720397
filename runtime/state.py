"""The adaptation state and its file format.

A state file is an ``.npz`` holding every array of :class:`AdaptState` plus ``__meta__`` (JSON:
scalars, the model fingerprint, and a SHA-256 over all arrays). It is written atomically; a
truncated or tampered file fails the checksum and is refused with :class:`StateError`.

The checksum proves integrity, not sense: anyone can re-sign a state. So every state is also
validated before it is used: member sizes from the archive's headers before anything is
decompressed, every array 1-D, floating and finite, every scalar of its type and range.

A state of another model (another fingerprint, or adapted parameters, features or classes of
other sizes) is refused first, in words: "this state is for another model (P' adapted
parameters, F' features, K' classes; saved by METHOD), not this one (P ..., F ..., K ...)",
the sizes read from the archive's headers alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write_bytes

STATE_VERSION = 5
_REQUIRED_ARRAYS = (
    "theta", "anchor", "center", "mean", "second_moment", "velocity", "healthy_theta",
)
# the domain bank's slots, one after the other (runtime.bank); absent from version-3 files
BANK_ARRAYS = ("bank_keys", "bank_theta", "bank_shift", "bank_moments", "bank_scalars",
               "bank_shift_classes")
# the activation shift's class mixes (runtime.shift); absent from version-4 files
SHIFT_CLASS_ARRAYS = ("shift_classes", "shift_recent_classes", "shift_prior")
# absent from version-2 files (the shift windows), version-3 ones (the bank) and version-4
# ones (the class mixes)
_OPTIONAL_ARRAYS = ("shift_mean", "shift_recent", *SHIFT_CLASS_ARRAYS, *BANK_ARRAYS)
# float32, as stored
_PARAMETER_ARRAYS = ("theta", "anchor", "velocity", "healthy_theta", "bank_theta")
_ARRAY_FIELDS = (*_REQUIRED_ARRAYS, *_OPTIONAL_ARRAYS)
_COUNTS = (  # ints in [0, COUNT_LIMIT] (the seed: [0, 2^63))
    "step", "skipped", "seed", "clipped_coefs", "clipped_steps", "guard_trips", "pause_left",
)
# The most a counter may hold: every integer up to it is exact in a JSON reader's double, and at
# a million steps a second a server reaches it in 285 years. A written state holds its counters
# at most this (they saturate there), so a server always reads back what it wrote, whatever
# traffic came after a state at the limit was installed.
COUNT_LIMIT = 2**53
_SATURATING = ("step", "skipped", "clipped_coefs", "clipped_steps", "guard_trips")
_WEIGHTS = (  # floats in [0, 1]
    "stat_weight", "coef_weight", "shift_weight", "shift_recent_weight", "budget_fill",

)
_MAGNITUDES = (
    "coef_scale", "balance_in", "balance_out", "anchor_credit", "shift_sq", "shift_recent_sq",
)  # finite floats >= 0
_NPY_HEADER_BYTES = 1024  # an .npy member's header, generously
_META_BYTES = 1 << 16


class StateError(ValueError):
    """A state file or dict is corrupt, or belongs to another model."""


class StateMismatch(StateError):
    """A sound state that this model or server cannot use as it is: another model's, another
    method's, or an adapted theta for a server that serves theta0 (the one-forward tier)."""


@dataclass
class AdaptState:
    """Everything that evolves while adapting. theta, anchor, velocity: [P]; center: [K];
    mean, second_moment: [F] (windowed means of h and h^2); arrays are float32 (float64 for the
    statistics).

    stat_weight: total weight 1 - a^n of the n samples in center / mean / second_moment (0 =
    none yet; see :func:`rates.windowed_update`). coef_scale, coef_weight: the running scale of
    the SPSA coefficients and its weight. clipped_coefs, clipped_steps: counts of clipped
    coefficients and of steps cut to the trust radius. healthy_theta: the health guard's last
    healthy checkpoint [P]; guard_trips: its trips; pause_left: samples to predict without
    adapting; frozen: no adaptation until unfrozen (an admin's or the user's switch).
    shift_mean, shift_sq, shift_weight: the activation shift's windowed test-time mean of the
    head input [D] (float64; empty until the shift is used), mean squared norm and weight;
    shift_recent, shift_recent_sq, shift_recent_weight: the same over its short change window.
    shift_classes, shift_prior: the predicted class mix [K] of the shift's long window (weight
    shift_weight) and of the stream's long run (starts balanced); empty unless the shift corrects
    for label shift; shift_recent_classes: the class mix of the short change window.
    budget_fill: the compute budget's credit as a share of its bucket (1 = full; :mod:`.budget`).
    bank_keys, bank_theta, bank_shift, bank_moments, bank_scalars, bank_shift_classes: the
    domain bank's slots, flattened one after the other (:mod:`.bank`; empty when it holds none;
    the class mixes also when the shift does not correct for label shift).
    """

    theta: np.ndarray
    anchor: np.ndarray
    center: np.ndarray
    mean: np.ndarray
    second_moment: np.ndarray
    velocity: np.ndarray
    healthy_theta: np.ndarray
    stat_weight: float = 0.0
    coef_scale: float = 0.0
    coef_weight: float = 0.0
    clipped_coefs: int = 0
    clipped_steps: int = 0
    guard_trips: int = 0
    pause_left: int = 0
    frozen: bool = False
    balance_in: float = 0.0
    balance_out: float = 0.0
    anchor_credit: float = 0.0
    step: int = 0
    skipped: int = 0
    seed: int = 0
    shift_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shift_sq: float = 0.0
    shift_weight: float = 0.0
    shift_recent: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shift_recent_sq: float = 0.0
    shift_recent_weight: float = 0.0
    shift_classes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shift_recent_classes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shift_prior: np.ndarray = field(default_factory=lambda: np.zeros(0))
    budget_fill: float = 1.0
    bank_keys: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bank_theta: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    bank_shift: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bank_moments: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bank_scalars: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bank_shift_classes: np.ndarray = field(default_factory=lambda: np.zeros(0))

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
            healthy_theta=theta0.copy(),
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
        ``stat_weight``, no coefficient scale, no guard) load: full statistics weigh 1, the
        scale starts empty, the healthy checkpoint is the state's theta; states without an
        activation-shift mean (version 2 and older) start it empty."""
        values = dict(values)
        if "moments_ready" in values and "stat_weight" not in values:
            values["stat_weight"] = 1.0 if values.pop("moments_ready") else 0.0
        if "healthy_theta" not in values and "theta" in values:
            values["healthy_theta"] = values["theta"]
        names = {f.name for f in fields(cls)}
        optional = {"coef_scale", "coef_weight", "clipped_coefs", "clipped_steps",
                    "guard_trips", "pause_left", "frozen", "shift_mean", "shift_weight",
                    "shift_sq", "shift_recent", "shift_recent_sq", "shift_recent_weight",
                    "budget_fill",
                    *SHIFT_CLASS_ARRAYS, *BANK_ARRAYS}
        missing = sorted(set(names) - optional - set(values))
        if missing:
            raise StateError(f"state lacks {missing}")
        kwargs = {k: v for k, v in values.items() if k in names}
        for name in _ARRAY_FIELDS:
            if name in kwargs:
                kwargs[name] = _checked_array(name, kwargs[name])
        for name in _COUNTS:
            if name in kwargs:
                kwargs[name] = _checked_count(name, kwargs[name])
        for name in ("skipped", "clipped_steps", "guard_trips"):  # each counts steps
            if kwargs.get(name, 0) > kwargs["step"]:
                raise StateError(f"state {name} = {kwargs[name]} exceeds step = {kwargs['step']}")
        for name in (*_WEIGHTS, *_MAGNITUDES):
            if name in kwargs:
                kwargs[name] = _checked_float(name, kwargs[name], name in _WEIGHTS)
        if "frozen" in kwargs and not isinstance(kwargs["frozen"], bool):
            raise StateError(f"state frozen must be true or false, got {kwargs['frozen']!r:.40}")
        return cls(**kwargs)


def _checked_array(name: str, value: Any) -> np.ndarray:
    array = np.array(value, copy=True)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.floating):
        raise StateError(f"state {name} must be a 1-D float array, got {array.dtype} "
                         f"{list(array.shape)}")
    if not np.isfinite(array).all():
        raise StateError(f"state {name} holds NaN or infinite values")
    if name == "second_moment" and (array < 0).any():
        raise StateError("state second_moment holds negative values")
    if name in SHIFT_CLASS_ARRAYS and array.size and (
            (array < 0).any() or abs(float(array.sum()) - 1.0) > 1e-6):
        raise StateError(f"state {name} must be a class mix: values >= 0 summing to 1")
    if name in _PARAMETER_ARRAYS:  # the engine computes in float32: the values must fit it
        if array.size and np.abs(array).max() > np.finfo(np.float32).max:
            raise StateError(f"state {name} holds values beyond float32's range")
        return array.astype(np.float32)
    return array.astype(np.float64)


def _checked_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StateError(f"state {name} must be an integer, got {value!r:.40}")
    if name == "seed":
        if not 0 <= int(value) < 2**63:
            raise StateError(f"state seed = {int(value)} is out of range [0, 2^63)")
    elif not 0 <= int(value) <= COUNT_LIMIT:
        raise StateError(f"state {name} = {int(value)} is out of range [0, 2^53] (a counter "
                         "adaptation reaches in centuries)")
    return int(value)


def _checked_float(name: str, value: Any, unit: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise StateError(f"state {name} must be a number, got {value!r:.40}")
    number = float(value)
    if not np.isfinite(number) or number < 0 or (unit and number > 1):
        raise StateError(f"state {name} = {number} is out of range "
                         f"{'[0, 1]' if unit else '[0, inf)'}")
    return number


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
    """Serialise ``state`` (+ model fingerprint and free-form ``info``) to npz bytes; an empty
    domain bank writes no ``bank_*`` members and a shift without the label-shift correction no
    class mixes, so such a state reads wherever a version-3 state did."""
    arrays = {name: getattr(state, name) for name in _ARRAY_FIELDS
              if name not in (*BANK_ARRAYS, *SHIFT_CLASS_ARRAYS) or getattr(state, name).size}
    scalars = {
        f.name: getattr(state, f.name) for f in fields(state) if f.name not in _ARRAY_FIELDS
    }
    for name in _SATURATING:  # a forged non-integer is written as it is: the reader refuses it
        value = scalars[name]
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            scalars[name] = min(int(value), COUNT_LIMIT)
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


def check_state_sizes(state: AdaptState, sizes: dict[str, int]) -> None:
    """Every array of ``state`` against a model's sizes (elements per array): the
    activation-shift windows hold at most their size (empty until used), the rest exactly;
    StateError names the first that does not fit (the state is for another model)."""
    for name, size in sizes.items():
        value = getattr(state, name)
        if name in _OPTIONAL_ARRAYS:
            if value.size > size:
                raise StateError(f"this state is for another model: state {name} has "
                                 f"{value.size} values, this model's at most {size}")
        elif value.shape != (size,):
            raise StateError(f"this state is for another model: state {name} has shape "
                             f"{value.shape}, this model needs ({size},)")


def check_member_sizes(data: bytes, sizes: dict[str, int]) -> None:
    """Refuse an archive whose members would decompress or load beyond what ``sizes`` (elements
    per array) allows, from the zip headers and each member's ``.npy`` header alone (nothing
    is decompressed beyond those headers, no array is allocated); also unknown members and
    members that are not 1-D float arrays (``__meta__``: one string)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as err:
        raise StateError(f"unreadable state (truncated or not a state file): {err}") from err
    for member in members:
        name = member.filename.removesuffix(".npy")
        if name == "__meta__":
            limit = _META_BYTES
        elif name in sizes:
            limit = sizes[name] * 8 + _NPY_HEADER_BYTES
        else:
            raise StateError(f"state archive has an unknown member {member.filename!r}")
        if member.file_size > limit:
            raise StateError(
                f"state member {member.filename!r} unpacks to {member.file_size} bytes; "
                f"this model's state needs at most {limit}"
            )
        shape, dtype = _npy_header(archive, member)
        if name == "__meta__":
            if shape != () or dtype.kind != "U":
                raise StateError("state member '__meta__' must hold one string")
        elif len(shape) != 1 or dtype.kind != "f" or shape[0] > sizes[name]:
            raise StateError(
                f"state member {member.filename!r} declares a {dtype} array of shape "
                f"{list(shape)}; this model's state needs at most {sizes[name]} floats"
            )


def _npy_header(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> tuple[tuple, np.dtype]:
    """(shape, dtype) from a member's ``.npy`` header, read without loading the array."""
    try:
        with archive.open(member) as stream:
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
            else:
                raise ValueError(f"unsupported .npy version {version}")
    except (OSError, ValueError, SyntaxError, zipfile.BadZipFile, EOFError) as err:
        raise StateError(f"state member {member.filename!r} is not a readable array: "
                         f"{str(err)[:200]}") from err
    if dtype.hasobject:
        raise StateError(f"state member {member.filename!r} holds Python objects")
    return shape, dtype


# the arrays whose sizes are the model's: adapted parameters, features, classes
_MODEL_SIZES = (("theta", "adapted parameters"), ("mean", "features"), ("center", "classes"))


def _foreign(data: bytes, fingerprint: str | None, sizes: dict[str, int] | None,
             name: str | None = None) -> str | None:
    """Why the state in ``data`` is for another model than the one of ``fingerprint`` and
    ``sizes`` (elements per array), named ``name``: both models by their architecture (the
    state's as recorded at saving) and sizes, and the state's method;
    None when it is not, or cannot be told (an unreadable archive is refused by the checks
    that follow). Reads the zip directory, the ``.npy`` headers of theta, mean and center and
    ``__meta__`` (at most ``_META_BYTES``), nothing else."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = {m.filename.removesuffix(".npy"): m for m in archive.infolist()}
        shapes = {name: _npy_header(archive, members[name])[0] for name, _ in _MODEL_SIZES}
    except (KeyError, ValueError, StateError, zipfile.BadZipFile):
        return None
    if any(len(shape) != 1 for shape in shapes.values()):
        return None  # refused as malformed by check_member_sizes / from_dict
    recorded = {name: int(shape[0]) for name, shape in shapes.items()}
    meta = _small_meta(archive, members.get("__meta__"))
    ours = dict(sizes or {})
    differ = any(name in ours and recorded[name] != ours[name] for name, _ in _MODEL_SIZES)
    recorded_fingerprint = meta.get("fingerprint")
    if not differ and (fingerprint is None or not isinstance(recorded_fingerprint, str)
                       or recorded_fingerprint == fingerprint):
        return None  # the same model, or metadata the checks that follow refuse by name
    info = meta.get("info")
    method = info.get("method") if isinstance(info, dict) else None
    model = info.get("model") if isinstance(info, dict) else None
    saved = f"; saved by {method}" if isinstance(method, str) and method else ""
    theirs = f"{model}: " if isinstance(model, str) and model else ""
    mine = f"{name}: " if name else ""
    this = f", not this one ({mine}{_sizes_in_words(ours)})" if ours else ""
    same = "; the same sizes, another architecture or theta0" if ours and not differ else ""
    return (f"this state is for another model ({theirs}{_sizes_in_words(recorded)}{saved})"
            f"{this}"
            f"{same}")


def _small_meta(archive: zipfile.ZipFile, member: zipfile.ZipInfo | None) -> dict[str, Any]:
    """The ``__meta__`` JSON object of ``archive`` when it is one string of at most
    ``_META_BYTES``, else ``{}`` (the checks that follow refuse it)."""
    if member is None or member.file_size > _META_BYTES:
        return {}
    try:
        with archive.open(member) as stream:
            meta = json.loads(str(np.lib.format.read_array(stream, allow_pickle=False)))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return {}
    return meta if isinstance(meta, dict) else {}


def _sizes_in_words(sizes: dict[str, int]) -> str:
    """``"1536 adapted parameters, 192 features, 10 classes"`` of the model-sized arrays."""
    return ", ".join(f"{sizes[name]} {words}" for name, words in _MODEL_SIZES if name in sizes)


def decode_state(
    data: bytes, fingerprint: str | None = None, sizes: dict[str, int] | None = None,
    name: str | None = None,
) -> tuple[AdaptState, dict]:
    """Parse npz bytes; refuse a state of another model first (:func:`_foreign`: the
    fingerprint and the sizes in the archive's headers), then check member sizes (``sizes``:
    elements per array, see :func:`check_member_sizes`), the checksum, the model fingerprint
    (if given) and every value (:meth:`AdaptState.from_dict`); ``name``: this model's
    architecture, for the refusal's words."""
    foreign = _foreign(data, fingerprint, sizes, name)
    if foreign is not None:
        raise StateMismatch(foreign)
    if sizes is not None:
        check_member_sizes(data, sizes)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["__meta__"]))
            present = [n for n in _OPTIONAL_ARRAYS if n in npz.files]
            arrays = {name: npz[name] for name in (*_REQUIRED_ARRAYS, *present)}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as err:
        raise StateError(f"unreadable state (truncated or not a state file): {err}") from err
    if not isinstance(meta, dict):
        raise StateError("state metadata '__meta__' must be a JSON object")
    version = meta.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise StateError(f"state version must be an integer, got {version!r:.40}")
    if version > STATE_VERSION:
        raise StateError(f"state version {version} is newer than this runtime")
    if _digest(arrays) != meta.get("sha256"):
        raise StateError("state checksum mismatch: the file is corrupt or was modified")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise StateMismatch("this state is for another model (its fingerprint differs)")
    scalars = meta.get("scalars")
    if not isinstance(scalars, dict):
        raise StateError("state metadata has no scalars")
    state = AdaptState.from_dict({**arrays, **scalars})
    info = meta.get("info", {})
    return state, info if isinstance(info, dict) else {}


def write_state_file(path: str | os.PathLike, data: bytes) -> Path:
    """Atomically write encoded state bytes."""
    return atomic_write_bytes(path, data)


def read_state_file(
    path: str | os.PathLike, fingerprint: str | None = None, sizes: dict[str, int] | None = None,
    name: str | None = None,
):
    """Read and verify a state file; returns (AdaptState, info) (``name``: as in
    :func:`decode_state`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"state file not found: {path}")
    try:
        return decode_state(path.read_bytes(), fingerprint, sizes, name)
    except StateError as err:
        raise type(err)(f"{path}: {err}") from err
