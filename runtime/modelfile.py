"""Read and rewrite the metadata of an adaptable ``.onnx`` file (no ORT session needed)."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from .atomic import atomic_write_bytes
from .metadata import META_KEY, ModelFormatError, ModelMetadata


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse an ONNX file, with a clear error for a missing or unreadable one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        return onnx.load(str(path))
    except Exception as err:  # onnx raises DecodeError and friends
        raise ModelFormatError(f"{path} is not a readable ONNX file: {err}") from err


def read_metadata(model: onnx.ModelProto | str | os.PathLike) -> ModelMetadata:
    """The eva0-edge metadata of a model file or parsed model (a file's errors name it)."""
    if isinstance(model, onnx.ModelProto):
        return ModelMetadata.from_props({p.key: p.value for p in model.metadata_props})
    parsed = load_onnx(model)
    try:
        return ModelMetadata.from_props({p.key: p.value for p in parsed.metadata_props})
    except ModelFormatError as err:
        raise ModelFormatError(f"{model}: {err}") from err


def set_metadata(model: onnx.ModelProto, metadata: ModelMetadata) -> onnx.ModelProto:
    """Replace the eva0-edge entries of ``model.metadata_props`` in place; return ``model``."""
    keep = [p for p in model.metadata_props if not p.key.startswith(META_KEY.split(".")[0] + ".")]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for key, value in metadata.to_props().items():
        model.metadata_props.add(key=key, value=value)
    return model


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write a self-contained ONNX file atomically (models must stay under protobuf's 2 GB)."""
    return atomic_write_bytes(path, model.SerializeToString())
