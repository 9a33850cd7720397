"""The source-free mode, for a model file without source statistics (no clean images).

A user who received a model as a file has no clean source images to ``calibrate`` on, so the
file has no ``source_mean`` / ``source_std`` (EVA-0's l_SWA term) and no ``head_input_mean``
(the activation shift's target). EVA-0-dagger then adapts on the entropy E_SR alone; on the
shipped Fashion-MNIST models that gains almost nothing (``studies/source-free/``): most of
EVA-0's gain there is the activation shift, and the entropy-only SPSA step does not move
accuracy at any step size. The source-free mode adds the shift back with a target that needs
no source images (:class:`~.shift.SourceFreeShift`: the windowed mean logit made equal across
classes, from the head's weights and the unlabelled test stream).

:func:`setup_source_free` writes what that mode needs into a file: the source-free shift's
strength and window (``free_shift``, ``shift_window``) in the tuned values of ``eva0-dagger``,
and, for a file without source statistics, of ``eva0`` too (which runs with lambda_swa = 0 on
such a file), after checking that the head can be read from the graph; values already tuned
for the file (the shipped models') are kept. :func:`strip_source_statistics` makes the
never-calibrated copy of a calibrated file that the measurements of the mode run on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .head import HeadError
from .metadata import ModelMetadata
from .modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from .registry import SOURCE_FREE_SHIFT
from .session import AdaptableSession
from .shift import load_free_shift

# the arrays calibration on clean images writes (source feature moments, source head mean and
# per-class means)
SOURCE_ARRAYS = ("source_mean", "source_std", "head_input_mean", "head_input_class_means")
# what calibration and the guard / shift fitting write besides the arrays
_CALIBRATED_EVA0 = ("activation_shift", "shift_max", "shift_window", "guard")
# the family-independent default of the source-free shift (eva0-dagger's own overrides)
SOURCE_FREE_DEFAULT: dict[str, Any] = dict(SOURCE_FREE_SHIFT)
FITTED_KEY = "source-free"


def strip_source_statistics(model_path: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write ``model_path`` to ``output`` as it was before ``calibrate``: without the source
    arrays (:data:`SOURCE_ARRAYS`), the fitted guard bounds, eva0's fitted shift and guard
    values and the ``fitted`` records of the guard and the shift. Every other tuned value is
    kept (the rates were tuned on labelled validation images, which a source-free setup of the
    shipped models may use). Returns the output path."""
    model = load_onnx(model_path)
    md = read_metadata(model)
    md.arrays = {k: v for k, v in md.arrays.items() if k not in SOURCE_ARRAYS}
    md.recommended = {k: v for k, v in md.recommended.items() if not k.startswith("guard_")}
    if "eva0" in md.tuned:
        md.tuned = {**md.tuned, "eva0": {k: v for k, v in md.tuned["eva0"].items()
                                         if k not in _CALIBRATED_EVA0}}
    md.fitted = {k: v for k, v in md.fitted.items() if k not in ("guard", "activation_shift")}
    return save_onnx(set_metadata(model, md), output)


def setup_source_free(
    model_path: str | os.PathLike, output: str | os.PathLike | None = None,
) -> str:
    """Set up the source-free mode in ``model_path`` (written to ``output``, default in place)
    and return the one line to print.

    Writes ``free_shift`` and ``shift_window`` (:data:`SOURCE_FREE_DEFAULT`, unless the file
    already has tuned values for them) into the tuned values of ``eva0-dagger``; for a file
    without source statistics also into ``eva0``'s, with ``lambda_swa`` 0 (no source moments
    to align to) and no source activation shift; and a ``fitted["source-free"]`` record. The
    head is read from the graph and checked against a forward first (one ORT session, two
    random images); when it cannot be shifted the mode is entropy-only and the line says why.
    A file with source statistics keeps eva0 as it is (calibrated EVA-0 is the better mode).
    """
    model = load_onnx(model_path)
    md = read_metadata(model)
    target = Path(output) if output is not None else Path(model_path)
    try:
        load_free_shift(AdaptableSession(model_path, md, provider="cpu", threads=1), 1.0, 256.0)
        shift_reason = None
    except HeadError as err:
        shift_reason = str(err)
    methods = ["eva0-dagger"] if md.has_source_stats else ["eva0-dagger", "eva0"]
    tuned = dict(md.tuned)
    for method in methods:
        values = dict(tuned.get(method, {}))
        if method == "eva0":
            values = {k: v for k, v in values.items() if k not in ("activation_shift", "shift_max")}
            values["lambda_swa"] = 0.0
        for key, default in SOURCE_FREE_DEFAULT.items():
            values.setdefault(key, default)
        if shift_reason is not None:
            values["free_shift"] = 0.0
        tuned[method] = values
    md.tuned = tuned
    strength = tuned["eva0-dagger"]["free_shift"]
    md.fitted = {**md.fitted, FITTED_KEY: {
        "by": "setup_source_free", "from": "the model file alone (the classifier's weights)",
        "methods": methods, "free_shift": strength,
        "shift_window": tuned["eva0-dagger"]["shift_window"], "shift_off_reason": shift_reason}}
    save_onnx(set_metadata(model, md), target)
    which = " and ".join(methods)
    if shift_reason is not None:
        return (f"source-free mode set up in {target} for {which} without the source-free shift "
                f"(entropy only): {shift_reason}")
    stats = ("" if md.has_source_stats
             else " (no source statistics: eva0 runs source-free, lambda_swa 0)")
    return (f"source-free mode set up in {target} for {which}{stats}: source-free activation "
            f"shift {strength:g} over {tuned['eva0-dagger']['shift_window']:g} samples, "
            "from the classifier's weights and the test stream; no clean images used")


def drop_source_free_eva0(metadata: ModelMetadata) -> ModelMetadata:
    """``metadata`` with eva0's source-free values removed (``lambda_swa`` 0 and the
    source-free shift that :func:`setup_source_free` wrote for a file without source
    statistics), for ``calibrate --data`` to call once it adds source statistics: calibrated
    EVA-0 then runs with l_SWA and the source shift again. eva0-dagger keeps its values (it is
    source-free by definition). Changes ``metadata`` in place and returns it."""
    record = metadata.fitted.get(FITTED_KEY)
    if record is None or "eva0" not in record.get("methods", []):
        return metadata
    eva0 = {k: v for k, v in metadata.tuned.get("eva0", {}).items()
            if k not in ("lambda_swa", *SOURCE_FREE_SHIFT)}
    metadata.tuned = {**metadata.tuned, "eva0": eva0}
    metadata.fitted = {**metadata.fitted,
                       FITTED_KEY: {**record, "methods": ["eva0-dagger"]}}
    return metadata
