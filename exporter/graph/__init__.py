"""Any ONNX image classifier -> an adaptable model file, by rewriting its graph with onnx-ir.

:func:`make_adaptable` reads the source (:mod:`.source`), finds its affines (:mod:`.affines`),
probes its batch axes (:mod:`.probe`), rewrites it (:mod:`.rewrite`), checks that the new
file's logits at theta0 equal the source's, and writes it with the metadata the runtime reads.
This package needs onnx, onnx-ir and onnxruntime only (no torch).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from eva0_edge.runtime.config import recommended_for_family
from eva0_edge.runtime.metadata import ModelMetadata, Preprocessing, Segment
from eva0_edge.runtime.modelfile import save_onnx, set_metadata

from .affines import Affine, AffineError, find_affines, select
from .probe import PROBE_BATCHES, Probe, ProbeError, probe
from .rewrite import RewriteError, rewrite
from .source import Source, SourceError, read_source

__all__ = [
    "Affine", "AffineError", "ProbeError", "RewriteError", "SourceError", "list_affines",
    "make_adaptable", "read_sidecar",
]

TOLERANCE = 1e-4
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _load(source: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        return copy
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX file not found: {path}")
    try:
        return onnx.load(str(path))
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise SourceError(f"{path} is not an ONNX model file: {err}") from err


def _analyse(proto: onnx.ModelProto, logits: str | None) -> tuple[
        Source, onnx.ModelProto, dict[str, Probe], list[Affine]]:
    """The parsed source, its batch-pinned graph (as probed), the probes and the affines."""
    source = read_source(proto, logits)
    pinned = ir.serde.serialize_model(source.model)
    names = [out.name for node in source.model.graph for out in node.outputs if out.name]
    probes = probe(pinned, source.pixels.name or "", source.sample_shape, names)
    probes["__pixels__"] = Probe("__pixels__", tuple(
        (b, *source.sample_shape) for b in PROBE_BATCHES), True, False)
    logits_probe = probes[source.logits.name or ""]
    if logits_probe.batch_axis != 0:
        raise SourceError(f"the logits {source.logits.name!r} are {list(logits_probe.shapes[0])} "
                          "at batch 2: need [N, K]")
    before_head = _ancestors(source.head_input)
    affines = [a for a in find_affines(source.model.graph, probes) if a.node in before_head]
    if not affines:
        raise SourceError(
            f"no norm or affine layer before the classifier head ({source.head.op_type} node "
            f"{source.head.name!r}): nothing to adapt. EVA-0 adapts LayerNorm / GroupNorm / "
            "BatchNorm / InstanceNorm affines, or convolutions with a folded BatchNorm")
    return source, pinned, probes, affines


def _ancestors(value: ir.Value) -> set[ir.Node]:
    seen: set[ir.Node] = set()
    frontier = [value]
    while frontier:
        producer = frontier.pop().producer()
        if producer is not None and producer not in seen:
            seen.add(producer)
            frontier.extend(v for v in producer.inputs if v is not None)
    return seen


def default_adapt(affines: Sequence[Affine]) -> str:
    """The affines adapted when ``--adapt`` is not given: the later half, by graph order
    (where a step costs least over a plain forward and the paper's sets lie)."""
    first = len(affines) // 2
    return f"{first}-{len(affines) - 1}"


def list_affines(source: str | os.PathLike | onnx.ModelProto,
                 logits: str | None = None) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """(index, op, name, weight shape) of every adaptable affine before the head."""
    *_, affines = _analyse(_load(source), logits)
    return [(i, a.op, a.base_name, tuple(a.weight0.shape)) for i, a in enumerate(affines)]


def read_sidecar(path: str | os.PathLike) -> tuple[list[str] | None, dict]:
    """Labels and preprocessing from a JSON file: this project's keys (``labels``, ``mean``,
    ``std``, ``interpolation``, ``crop_pct``) or Hugging Face's (``id2label``, ``image_mean``,
    ``image_std``)."""
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    labels = values.get("labels")
    if labels is None and "id2label" in values:
        mapping = values["id2label"]
        labels = [mapping[str(i)] for i in range(len(mapping))]
    pre = {k: values[k] for k in ("interpolation", "crop_pct", "crop_mode") if k in values}
    for ours, theirs in (("mean", "image_mean"), ("std", "image_std")):
        if ours in values or theirs in values:
            pre[ours] = tuple(float(v) for v in values.get(ours, values.get(theirs)))
    return labels, pre


def _sidecar_for(source: str | os.PathLike | onnx.ModelProto) -> Path | None:
    if isinstance(source, onnx.ModelProto):
        return None
    path = Path(source)
    for candidate in (path.with_suffix(path.suffix + ".json"), path.with_suffix(".json")):
        if candidate.is_file():
            return candidate
    return None


def _preprocessing(source: Source, given: Preprocessing | None, sidecar: dict) -> Preprocessing:
    if given is not None:
        return given
    channels = source.sample_shape[0]
    if "mean" not in sidecar:
        warnings.warn("no preprocessing given (flags or a sidecar JSON): assuming ImageNet "
                      "mean / std; pass --mean / --std if the model was trained otherwise",
                      stacklevel=3)
    mean = sidecar.get("mean", IMAGENET[0][:channels])
    std = sidecar.get("std", IMAGENET[1][:channels])
    return Preprocessing(
        input_size=source.sample_shape,  # type: ignore[arg-type]
        mean=tuple(mean), std=tuple(std),
        interpolation=str(sidecar.get("interpolation", "bilinear")),
        crop_pct=float(sidecar.get("crop_pct", 1.0)),
        crop_mode=str(sidecar.get("crop_mode", "center")),
    )


def _check_equal(original: onnx.ModelProto, logits: str, input_name: str,
                 adaptable: onnx.ModelProto, theta0: np.ndarray,
                 sample_shape: tuple[int, ...]) -> float:
    """Max |logits(adaptable, theta0) - logits(source)| over 4 images at r = 1 and r = 2."""
    probed = onnx.ModelProto()
    probed.CopyFrom(original)
    del probed.graph.output[:]
    probed.graph.output.append(onnx.ValueInfoProto(name=logits))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = ort.InferenceSession(probed.SerializeToString(), options,
                                  providers=["CPUExecutionProvider"])
    target = ort.InferenceSession(adaptable.SerializeToString(), options,
                                  providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).uniform(-1, 1, (4, *sample_shape)).astype(np.float32)
    want = np.asarray(source.run(None, {input_name: x})[0]).reshape(4, -1)
    worst = 0.0
    for copies in (1, 2):
        theta = np.tile(theta0, (copies * len(x), 1))
        got = target.run(["logits"], {"pixel_values": x, "theta": theta})[0]
        worst = max(worst, float(np.abs(got - np.tile(want, (copies, 1))).max()))
    return worst / max(1.0, float(np.abs(want).max()))


def make_adaptable(
    source: str | os.PathLike | onnx.ModelProto,
    output: str | os.PathLike,
    *,
    adapt: str | None = None,
    labels: Sequence[str] | None = None,
    preprocessing: Preprocessing | None = None,
    logits: str | None = None,
    architecture: str | None = None,
    family: str = "onnx",
    default: str | None = None,
) -> ModelMetadata:
    """Rewrite the ONNX classifier ``source`` (a path or a ModelProto) to an adaptable model
    file at ``output``; return its metadata.

    ``adapt``: which affines (index ranges in graph order, or name patterns; see
    :func:`.affines.select`), by default ``default`` or the later half. ``labels`` and
    ``preprocessing`` win over a sidecar JSON (``model.onnx.json`` / ``model.json``, see
    :func:`read_sidecar`). ``logits``: the output to read when the graph has several.
    Refused with a :class:`ValueError` naming the node: no classifier head, no affine before
    it, a batch it cannot make dynamic, a file whose rewritten logits at theta0 differ from the
    source's by more than 1e-4 (relative to the largest logit, if above 1).
    """
    src, pinned, probes, affines = _analyse(_load(source), logits)
    spec = adapt or default or default_adapt(affines)
    chosen = select(affines, spec)
    sidecar_path = _sidecar_for(source)
    sidecar_labels, sidecar = read_sidecar(sidecar_path) if sidecar_path else (None, {})
    pre = _preprocessing(src, preprocessing, sidecar)
    logits_name, input_name = src.logits.name or "", src.pixels.name or ""
    model, layout, theta0, width = rewrite(src.model, src.pixels, src.logits, src.head_input,
                                           chosen, probes)
    error = _check_equal(pinned, logits_name, input_name, model, theta0, src.sample_shape)
    if error > TOLERANCE:
        raise RewriteError(f"the rewritten graph's logits at theta0 differ from the source's by "
                           f"{error:.2e} (relative): not written")
    num_classes = model.graph.output[0].type.tensor_type.shape.dim[1].dim_value
    names = list(labels) if labels is not None else sidecar_labels
    if names is not None and len(names) != num_classes:
        raise ValueError(f"{len(names)} labels given for a model with {num_classes} classes")
    metadata = ModelMetadata(
        architecture=architecture or (Path(source).stem if not isinstance(
            source, onnx.ModelProto) else "onnx"),
        family=family,
        labels=names or [f"class_{i}" for i in range(num_classes)],
        preprocessing=pre,
        theta_layout=layout,
        feature_layout=[Segment("head_input", 0, width, (width,))],
        adapt=spec,
        prefix=f"the graph before {chosen[0].op} {chosen[0].base_name}",
        recommended=recommended_for_family(family),
        arrays={"theta0": theta0},
    )
    save_onnx(set_metadata(model, metadata), output)
    return metadata
