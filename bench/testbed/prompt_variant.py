"""The black-box prompt variant of a shipped testbed model, for the prompt methods (``foa``,
``foa-dagger``, ``eva0-clubs``): the same torch source weights exported with T prompt tokens
(``eva0-edge export --prompts T``), its source statistics taken from the same clean training
images as the shipped file's, its recommended values the best of
``models/<arch>_prompt.tune*.json`` (``models/recipes/tune.py --method eva0-clubs``, validation
split), and FOA's tuned values those of the shipped file (``models/recipes/tune.py --method
foa``). Generated once into the cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from eva0_edge.runtime.cache import cache_dir
from eva0_edge.runtime.calibrate import calibrate_with_images
from eva0_edge.runtime.engine import model_fingerprint
from eva0_edge.runtime.foa import FOA_METHODS
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

from .fashion_mnist import CALIBRATION_IMAGES, clean_training_images

PROMPT_TOKENS = 3  # FOA's prompt count on ViT-Base


def tune_log_path(arch: str) -> Path:
    from .backprop import SHIPPED_MODELS_DIR

    return SHIPPED_MODELS_DIR / f"{arch}_prompt.tune.json"


def tuned_values(arch: str) -> dict[str, Any]:
    """The best configuration over the prompt variant's tuning logs
    (``<arch>_prompt.tune*.json``, e.g. a first grid and a wider one); {} without any."""
    log = tune_log_path(arch)
    bests = [json.loads(p.read_text())["best"]
             for p in sorted(log.parent.glob(f"{arch}_prompt.tune*.json"))]
    if not bests:
        return {}
    best = dict(max(bests, key=lambda b: b["val_accuracy"]))
    best.pop("val_accuracy")
    return best


def prompt_variant(
    model_path: str | os.PathLike,
    tokens: int = PROMPT_TOKENS,
    torch_checkpoint: str | os.PathLike | None = None,
) -> Path:
    """A prompt model with ``model_path``'s weights (``model_path`` itself if it is one).

    Only the testbed architectures can be rebuilt here (their torch weights ship beside them and
    their clean data is known); for any other model export and calibrate the prompt model
    yourself and pass it as the prompt model.
    """
    from .backprop import load_torch_source
    from .testbed_archs import ARCHS

    metadata = read_metadata(model_path)
    if metadata.is_prompt_model:
        return Path(model_path)
    if metadata.architecture not in ARCHS:
        raise ValueError(
            f"the prompt methods need a prompt model of {metadata.architecture}: export it with "
            "`eva0-edge export --prompts 3`, calibrate it, and pass it with --prompt-model"
        )
    tuned = tuned_values(metadata.architecture)
    foa_tuned = {m: v for m, v in metadata.tuned.items() if m in FOA_METHODS}
    tuned_key = hashlib.sha256(
        json.dumps([tuned, foa_tuned], sort_keys=True).encode()
    ).hexdigest()[:8]
    out = cache_dir() / "prompt_models" / (
        f"{metadata.architecture}-p{tokens}-{model_fingerprint(metadata)}-{tuned_key}.onnx"
    )
    if out.is_file():
        return out
    from eva0_edge.exporter import export_model

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + f".{os.getpid()}.partial.onnx")
    export_model(
        metadata.architecture, partial, model=load_torch_source(metadata, torch_checkpoint),
        labels=metadata.labels, preprocessing=metadata.preprocessing, prompts=tokens,
    )
    calibrate_with_images(partial, clean_training_images(), CALIBRATION_IMAGES, seed=0)
    if tuned or foa_tuned:
        model = load_onnx(partial)
        prompt_metadata = read_metadata(model)
        prompt_metadata.recommended = {**prompt_metadata.recommended, **tuned}
        prompt_metadata.tuned = {**prompt_metadata.tuned, **foa_tuned}
        save_onnx(set_metadata(model, prompt_metadata), partial)
    os.replace(partial, out)
    return out
