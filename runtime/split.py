"""Split an adaptable model file into its shared prefix and its adapted suffix, so one step runs
the prefix once on the B images and the suffix on the theta copies in as many calls as a
memory budget allows (issue: two forwards at the memory of one).

The boundary is found from the graph itself, for every file the exporter writes (float,
quantized, prompt models): the suffix is everything that depends on the adapted input
(``theta``, or ``prompt`` and ``head_shift``); the boundary tensors are the ones computed from
``pixel_values`` without it and read by the suffix (the prefix's hidden state and feature taps
before they are tiled to the theta rows, and the batch size). :func:`split_model` cuts there
with ``onnx.utils.Extractor``; the two parts share no weight (only a few scalar constants).
:func:`split_files` writes the parts once into the cache (``cache_dir()/split/<sha256 of the
file>``), so a device loads each weight once, with ONNX Runtime's own loader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx.utils import Extractor

from .atomic import atomic_write_bytes
from .cache import cache_dir, file_digest

ADAPTED_INPUTS = ("theta", "prompt", "head_shift")


@dataclass
class SplitModel:
    """The two parts: ``prefix`` (pixel_values -> ``boundary``) and ``suffix`` (``boundary`` +
    the adapted inputs -> the file's outputs); ``row_elements``: an estimate of the elements
    one theta row of the suffix keeps alive (3 x its largest activation per row)."""

    prefix: onnx.ModelProto
    suffix: onnx.ModelProto
    boundary: list[str]
    row_elements: int


def _depends_on(graph: onnx.GraphProto, sources: set[str]) -> set[str]:
    """Every tensor computed (transitively) from ``sources``; nodes are in topological order."""
    reached = set(sources)
    for node in graph.node:
        if any(name in reached for name in node.input):
            reached.update(node.output)
    return reached


def find_boundary(graph: onnx.GraphProto) -> list[str]:
    """The tensors the suffix reads from the prefix, in graph order."""
    adapted = {i.name for i in graph.input} & set(ADAPTED_INPUTS)
    if not adapted:
        raise ValueError("the graph has no theta / prompt input: not an adaptable model file")
    suffix = _depends_on(graph, adapted)
    from_pixels = _depends_on(graph, {"pixel_values"})
    boundary: list[str] = []
    for node in graph.node:
        if not any(name in suffix for name in node.output):
            continue
        for name in node.input:
            if name in from_pixels and name not in suffix and name not in boundary:
                boundary.append(name)
    return boundary


def _row_elements(model: onnx.ModelProto) -> int:
    """3 x the largest per-row element count of the suffix's inferred activations (the
    symbolic row dimension left out): a rough per-row peak of live activations."""
    inferred = onnx.shape_inference.infer_shapes(model)
    largest = 1
    for info in inferred.graph.value_info:
        dims = info.type.tensor_type.shape.dim
        known = [d.dim_value for d in dims if d.HasField("dim_value")]
        if len(known) < len(dims):  # a symbolic row dimension: a per-row tensor
            largest = max(largest, int(np.prod(known)) if known else 1)
    return 3 * largest


def split_model(model: onnx.ModelProto) -> SplitModel:
    """Cut ``model`` (an exported adaptable file) into prefix and suffix."""
    graph = model.graph
    boundary = find_boundary(graph)
    adapted = [i.name for i in graph.input if i.name in ADAPTED_INPUTS]
    outputs = [o.name for o in graph.output]
    typed = {v.name for v in (*graph.value_info, *graph.input, *graph.output)}
    if any(name not in typed for name in boundary):  # a quantizer's output keeps no types
        model = onnx.shape_inference.infer_shapes(model)
    extractor = Extractor(model)
    prefix = extractor.extract_model(["pixel_values"], boundary)
    suffix = extractor.extract_model(boundary + adapted, outputs)
    for part in (prefix, suffix):
        part.metadata_props.extend(model.metadata_props)
    return SplitModel(prefix, suffix, boundary, _row_elements(suffix))


@dataclass(frozen=True)
class SplitFiles:
    """Where the parts of a split file lie, and what :class:`SplitModel` says of them."""

    prefix: Path
    suffix: Path
    boundary: list[str]
    row_elements: int


def split_files(path: str | os.PathLike, root: Path | None = None) -> SplitFiles:
    """The cached parts of the model file ``path`` (split and written on first use, atomically;
    the manifest last, so a folder with a manifest is complete). ``root``: default
    ``cache_dir()/split``."""
    folder = (root or cache_dir() / "split") / file_digest(Path(path))
    manifest = folder / "split.json"
    if not manifest.is_file():
        parts = split_model(onnx.load(str(path)))
        atomic_write_bytes(folder / "prefix.onnx", parts.prefix.SerializeToString())
        atomic_write_bytes(folder / "suffix.onnx", parts.suffix.SerializeToString())
        atomic_write_bytes(manifest, json.dumps(
            {"boundary": parts.boundary, "row_elements": parts.row_elements}).encode())
    info = json.loads(manifest.read_text())
    return SplitFiles(folder / "prefix.onnx", folder / "suffix.onnx", list(info["boundary"]),
                      int(info["row_elements"]))
