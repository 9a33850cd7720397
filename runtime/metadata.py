"""The adaptable-model metadata: what the exporter writes and the runtime reads.

Everything lives in the ONNX file's ``metadata_props`` so that ONNX Runtime exposes it through
``session.get_modelmeta().custom_metadata_map`` without a second parse of the weights:

* ``eva0_edge.meta``: JSON (architecture, labels, preprocessing, theta and feature layouts, ...);
* ``eva0_edge.array.<name>``: one float32 array each (``theta0``, ``source_mean``, ``source_std``),
  stored as base64 of its ``.npy`` bytes. Unused graph initializers would make ORT warn on load.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FORMAT_VERSION = 4
ADAPTED_INPUTS = ("theta", "prompt")
META_KEY = "eva0_edge.meta"
ARRAY_PREFIX = "eva0_edge.array."
ARRAY_NAMES = ("theta0", "source_mean", "source_std")


class ModelFormatError(ValueError):
    """The file is not an adaptable eva0-edge model, or its metadata is inconsistent."""


@dataclass(frozen=True)
class Segment:
    """A named slice ``[offset, offset + size)`` of a flat vector (theta or features)."""

    name: str
    offset: int
    size: int
    shape: tuple[int, ...] = ()


@dataclass
class Preprocessing:
    """How raw images become ``pixel_values``: resize/crop to ``input_size`` = (C, H, W), scale to
    [0, 1], then ``(x - mean) / std`` per channel."""

    input_size: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float = 1.0
    crop_mode: str = "center"


@dataclass
class ModelMetadata:
    """Everything the runtime needs besides the graph. Arrays are float32 1-D.

    ``theta_layout`` lists the adapted tensors in the order they appear in the ``theta`` input
    ([N_theta, P]); each name is the tensor's key in the source model's state dict.
    ``feature_layout`` lists the alignment taps concatenated in the ``features`` output ([N, F]).

    ``adapted_input`` names the graph input the runtime adapts: ``theta`` (norm affine, [R, P])
    or ``prompt`` (black-box prompt mode: [R, T, D] input prompt tokens after the CLS token, fed
    as theta rows of P = T * D values reshaped to ``theta_layout[0].shape``). ``black_box``: the
    weights are frozen in the graph and theta0 holds no weights (it is the initial prompt).

    ``recommended``: hyper-parameters for every method (AdaptConfig keys). ``tuned``: per method,
    the values its tuning on the validation split chose (``models/recipes/tune.py``), applied
    after the method's own settings: AdaptConfig keys for the runtime methods, ``lr`` for the torch
    baselines (format 3; absent in older files). ``fitted``: what the safety features and the
    rates were fitted on, per feature (``guard``, ``activation_shift``, ``rates``): the command
    that fitted them, the images and the margins (format 4; absent in older files).
    """

    architecture: str
    family: str
    labels: list[str]
    preprocessing: Preprocessing
    theta_layout: list[Segment]
    feature_layout: list[Segment]
    adapt: str
    prefix: str
    quantization: dict[str, Any] | None = None
    adapted_input: str = "theta"
    black_box: bool = False
    recommended: dict[str, Any] = field(default_factory=dict)
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)
    fitted: dict[str, dict[str, Any]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_params(self) -> int:
        """P, the width of the ``theta`` input."""
        return sum(s.size for s in self.theta_layout)

    @property
    def num_features(self) -> int:
        """F, the width of the ``features`` output."""
        return sum(s.size for s in self.feature_layout)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def is_prompt_model(self) -> bool:
        return self.adapted_input == "prompt"

    @property
    def theta0(self) -> np.ndarray:
        return self.arrays["theta0"]

    @property
    def has_source_stats(self) -> bool:
        return "source_mean" in self.arrays and "source_std" in self.arrays

    def validate(self) -> None:
        """Raise ModelFormatError if layouts and arrays disagree."""
        if self.adapted_input not in ADAPTED_INPUTS:
            raise ModelFormatError(
                f"adapted_input {self.adapted_input!r} is not one of {ADAPTED_INPUTS}"
            )
        if self.adapted_input == "prompt" and (
            len(self.theta_layout) != 1 or len(self.theta_layout[0].shape) != 2
        ):
            raise ModelFormatError("a prompt model's theta layout is one [T, D] prompt segment")
        for layout, what in ((self.theta_layout, "theta"), (self.feature_layout, "feature")):
            offset = 0
            for seg in layout:
                if seg.offset != offset or seg.size <= 0:
                    raise ModelFormatError(f"{what} layout is not contiguous at {seg.name!r}")
                offset += seg.size
        if "theta0" not in self.arrays:
            raise ModelFormatError("metadata has no theta0 array")
        if self.theta0.shape != (self.num_params,):
            raise ModelFormatError(
                f"theta0 has shape {self.theta0.shape}, layout says ({self.num_params},)"
            )
        for name in ("source_mean", "source_std"):
            if name in self.arrays and self.arrays[name].shape != (self.num_features,):
                raise ModelFormatError(
                    f"{name} has shape {self.arrays[name].shape}, "
                    f"feature layout says ({self.num_features},)"
                )

    def to_props(self) -> dict[str, str]:
        """Serialise into ``metadata_props`` key/value strings."""
        self.validate()
        meta = asdict(self)
        meta.pop("arrays")
        meta["format_version"] = FORMAT_VERSION  # what this runtime writes, whatever it read
        props = {META_KEY: json.dumps(meta, sort_keys=True)}
        for name, array in self.arrays.items():
            props[ARRAY_PREFIX + name] = _encode_array(array)
        return props

    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> ModelMetadata:
        """Parse ``metadata_props`` (as a mapping) back; raise ModelFormatError if absent/bad."""
        if META_KEY not in props:
            raise ModelFormatError(
                f"no {META_KEY!r} metadata: not an adaptable eva0-edge model "
                "(export one with `eva0-edge export`)"
            )
        try:
            meta = json.loads(props[META_KEY])
            version = meta.pop("format_version")
            if version > FORMAT_VERSION:
                raise ModelFormatError(
                    f"model format {version} is newer than this runtime ({FORMAT_VERSION})"
                )
            values: dict[str, Any] = {
                k: tuple(v) if isinstance(v, list) else v
                for k, v in meta["preprocessing"].items()
            }
            meta["preprocessing"] = Preprocessing(**values)
            for key in ("theta_layout", "feature_layout"):
                meta[key] = [
                    Segment(s["name"], s["offset"], s["size"], tuple(s.get("shape", ())))
                    for s in meta[key]
                ]
            arrays = {
                key[len(ARRAY_PREFIX):]: _decode_array(value)
                for key, value in props.items()
                if key.startswith(ARRAY_PREFIX)
            }
            result = cls(**meta, arrays=arrays, format_version=version)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ModelFormatError):
                raise
            raise ModelFormatError(f"corrupt eva0-edge metadata: {err}") from err
        result.validate()
        return result


def _encode_array(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode_array(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
