"""A user's own model, fitted as a user would fit it: ``calibrate`` fits the guard and the
activation shift to their clean images and turns both on, ``tune`` runs the project's rule on
their labelled images and writes the rates, ``info`` says what is fitted and from what.

The user's model here is the shipped ResNet-GN stripped of everything its recipes fitted
(source statistics, guard bounds, tuned values): what ``eva0-edge export`` gives for its
checkpoint. The images are Fashion-MNIST's validation split (never the test split)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.cli import main
from eva0_edge.runtime.fitting import learnt_bounds
from eva0_edge.runtime.methods import load_method
from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata
from tests.fixtures import SHIPPED_RESNET_GN

pytestmark = pytest.mark.integration
GUARD_BOUNDS = {"guard_entropy_min", "guard_entropy_max", "guard_spread_min",
                "guard_logit_norm_min", "guard_logit_norm_max", "guard_drift_max",
                "guard_alignment_max"}


@pytest.fixture(scope="module")
def users_model(tmp_path_factory):
    """The shipped ResNet-GN as its export is, before any fitting."""
    path = tmp_path_factory.mktemp("own") / "mine.onnx"
    model = load_onnx(SHIPPED_RESNET_GN)
    metadata = read_metadata(model)
    for name in ("source_mean", "source_std", "head_input_mean"):
        metadata.arrays.pop(name, None)
    metadata.recommended = {k: v for k, v in metadata.recommended.items()
                            if k in ("lambda_swa", "alpha")}
    metadata.tuned, metadata.fitted = {}, {}
    save_onnx(set_metadata(model, metadata), path)
    return path


@pytest.fixture(scope="module")
def validation_images():
    images, labels = corrupted_fmnist("val", "clean", 5, 7)
    return images[:600], labels[:600]


@pytest.fixture(scope="module")
def calibrated(users_model, validation_images, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cal")
    np.savez(folder / "clean.npz", x=validation_images[0][:400])
    out = folder / "calibrated.onnx"
    assert main(["calibrate", "--model", str(users_model), "--data", str(folder / "clean.npz"),
                 "-o", str(out), "--fit-clean", "256", "--fit-limit", "64", "-q",
                 "--fit-log", str(folder / "fit.json")]) == 0
    return out, json.loads((folder / "fit.json").read_text())


def test_calibrate_turns_the_guard_and_the_shift_on_with_fitted_bounds(calibrated):
    path, log = calibrated
    metadata = read_metadata(path)
    assert GUARD_BOUNDS <= set(metadata.recommended)
    assert {k: metadata.recommended[k] for k in GUARD_BOUNDS} == learnt_bounds(
        log["extremes"], 2.0)
    eva0 = metadata.tuned["eva0"]
    assert eva0["guard"] is True and eva0["activation_shift"] == 1.0
    assert eva0["shift_max"] == pytest.approx(max(log["distances"].values()) * 1.5, rel=1e-3)
    assert set(log["distances"]) == {*log["corruptions"], "clean"}
    assert metadata.fitted["guard"]["by"] == "calibrate"
    assert metadata.fitted["guard"]["clean_images"] == 256
    assert metadata.fitted["guard"]["images_per_corruption"] == 64
    stats = load_method(path, "eva0").stats()
    assert stats["guard"] is not None and stats["activation_shift"] is not None


def test_the_fitted_guard_never_trips_on_clean_images_and_stops_a_black_stream(
        calibrated, validation_images):
    path, _ = calibrated
    model = load_method(path, "eva0")
    pre = model.metadata.preprocessing
    from eva0_edge.runtime.preprocess import preprocess_uint8

    clean = preprocess_uint8(validation_images[0][400:600], pre)
    for start in range(0, len(clean), 8):
        model.step(clean[start:start + 8])
    assert model.stats()["guard"]["trips"] == 0
    black = np.zeros((256, 32, 32, 3), np.uint8)
    x = preprocess_uint8(black, pre)
    restarts = model.stats()["activation_shift"]
    for start in range(0, len(x), 8):
        model.step(x[start:start + 8])
    after = model.stats()
    assert after["guard"]["trips"] > 0 or after["activation_shift"] != restarts


def test_info_says_what_is_fitted_and_from_what(calibrated, users_model, capsys):
    assert main(["info", str(users_model)]) == 0
    before = capsys.readouterr().out
    assert "never fitted (off)" in before and "never tuned" in before
    assert main(["info", str(calibrated[0])]) == 0
    after = capsys.readouterr().out
    assert "fitted by calibrate on 256 clean images and 15 corruptions" in after
    shift = next(line for line in after.splitlines() if line.startswith("activation shift"))
    assert "strength 1 over 256 samples, bound" in shift and "fitted by calibrate" in shift


def test_tune_writes_the_rules_choice_from_class_folders(calibrated, validation_images,
                                                         tmp_path):
    images, labels = validation_images
    names = read_metadata(calibrated[0]).labels
    for i in range(120):
        folder = tmp_path / "val" / names[labels[i]].replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(folder / f"{i}.png")
    out = tmp_path / "tuned.onnx"
    assert main(["tune", "--model", str(calibrated[0]), "--data", str(tmp_path / "val"),
                 "-o", str(out), "--limit", "16", "--clean-limit", "32", "--batch-sizes",
                 "16", "--grid", "eta=0.01,0.02", "--extend", "0", "--shift-grid", "0.5,2",
                 "-q"]) == 0
    log = json.loads(out.with_name("tuned.tune-eva0.json").read_text())
    assert log["images"] == 120 and len(log["grid"]) == 2 and len(log["shift"]["grid"]) == 2
    assert log["shift"]["fixed"] == log["best"]["config"]  # the shift under the chosen eta
    metadata = read_metadata(out)
    assert metadata.tuned["eva0"]["eta"] == log["best"]["config"]["eta"]
    assert metadata.tuned["eva0"]["activation_shift"] == \
        log["shift"]["best"]["config"]["activation_shift"] in (0.5, 2.0)
    assert metadata.fitted["rates"]["values"] == {**log["best"]["config"],
                                                  **log["shift"]["best"]["config"]}
    assert metadata.fitted["guard"]["by"] == "tune"
    assert metadata.tuned["eva0"]["guard"] is True


def test_tune_reads_a_labels_file_and_names_an_unknown_class(calibrated, validation_images,
                                                             tmp_path):
    images, labels = validation_images
    np.save(tmp_path / "x.npy", images[:64])
    (tmp_path / "labels.csv").write_text(
        "image,label\n" + "".join(f"{i},{labels[i]}\n" for i in range(64)))
    args = ["tune", "--model", str(calibrated[0]), "--data", str(tmp_path / "x.npy"),
            "--labels", str(tmp_path / "labels.csv"), "--limit", "16", "--clean-limit", "16",
            "--batch-sizes", "16", "--grid", "eta=0.02", "--extend", "0", "--shift-grid", "",
            "-q"]
    assert main(args) == 0
    assert (tmp_path / "x.tune-eva0.json").exists() is False  # the log sits beside the model
    (tmp_path / "labels.csv").write_text("0,jumper\n")
    assert main(args) == 2


@pytest.mark.parametrize("which", ["users", "calibrated", "shipped"])
def test_adapt_says_in_one_line_what_was_never_fitted(which, users_model, calibrated,
                                                      validation_images, tmp_path, caplog):
    path = {"users": users_model, "calibrated": calibrated[0],
            "shipped": SHIPPED_RESNET_GN}[which]
    np.savez(tmp_path / "stream.npz", x=validation_images[0][:8])
    with caplog.at_level("WARNING", logger="eva0_edge"):
        assert main(["adapt", "--model", str(path), "--input", str(tmp_path / "stream.npz"),
                     "-o", str(tmp_path / "p.jsonl"), "-q"]) == 0
    said = [r.getMessage() for r in caplog.records if "never fitted" in r.getMessage()]
    expected = {"users": ["health guard", "rates"], "calibrated": ["rates"], "shipped": []}
    assert len(said) == (1 if expected[which] else 0)
    for part in expected[which]:
        assert part in said[0]
    if which == "calibrated":
        assert "health guard" not in said[0]


def test_calibrate_skips_an_undecodable_image_and_names_it(users_model, validation_images,
                                                           tmp_path, capsys):
    folder = tmp_path / "clean"
    folder.mkdir()
    for i in range(70):
        Image.fromarray(validation_images[0][i]).save(folder / f"{i:03d}.png")
    (folder / "050.png").write_bytes(b"not a png")
    out = tmp_path / "c.onnx"
    assert main(["calibrate", "--model", str(users_model), "--data", str(folder), "-o",
                 str(out), "-q", "--fit-clean", "64", "--fit-limit", "64", "--threads",
                 "1"]) == 0
    said = capsys.readouterr().out
    assert "from 69 images, 1 undecodable input(s) skipped (050.png)" in said
    assert read_metadata(out).fitted["guard"]["clean_images"] == 64


def test_calibrate_leaves_a_prompt_models_guard_alone_and_says_so(prompt_vit, tmp_path,
                                                                  capsys):
    images = np.random.default_rng(1).integers(0, 256, (70, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "clean.npz", x=images)
    out = tmp_path / "p.onnx"
    assert main(["calibrate", "--model", str(prompt_vit.onnx_path), "--data",
                 str(tmp_path / "clean.npz"), "-o", str(out), "-q"]) == 0
    assert "black-box prompt model" in capsys.readouterr().out
    assert read_metadata(out).has_source_stats and not read_metadata(out).fitted


def test_calibrate_without_data_sets_up_the_source_free_mode_and_says_so(
        users_model, validation_images, tmp_path, capsys):
    out = tmp_path / "free.onnx"
    assert main(["calibrate", "--model", str(users_model), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "source-free mode set up" in said and "no clean images used" in said
    metadata = read_metadata(out)
    assert not metadata.has_source_stats
    assert metadata.tuned["eva0"]["lambda_swa"] == 0.0 and metadata.tuned["eva0"]["free_shift"] > 0
    model = load_method(out, "eva0")
    assert model.stats()["activation_shift"] is not None  # the source-free shift runs
    from eva0_edge.runtime.info import unfitted_warning

    assert "rates" in unfitted_warning(metadata, "eva0", {})  # the mode is not a tuning
    np.savez(tmp_path / "clean.npz", x=validation_images[0][:100])
    again = tmp_path / "calibrated.onnx"
    assert main(["calibrate", "--model", str(out), "--data", str(tmp_path / "clean.npz"),
                 "-o", str(again), "--no-fit", "-q"]) == 0
    eva0 = read_metadata(again).tuned["eva0"]
    assert "lambda_swa" not in eva0 and "free_shift" not in eva0  # calibrated EVA-0 again
    assert load_method(again, "eva0").config.lambda_swa > 0


def test_a_timm_export_takes_the_normalisation_the_user_trained_with(tmp_path):
    out = tmp_path / "mine.onnx"
    args = ["export", "--arch", "resnet18", "--set", "num_classes=10", "--input-size",
            "3,32,32", "-q", "-o", str(out)]
    assert main([*args, "--mean", "0.2191,0.2191,0.2191", "--std", "0.3319,0.3319,0.3319"]) == 0
    pre = read_metadata(out).preprocessing
    assert pre.mean == (0.2191,) * 3 and pre.std == (0.3319,) * 3
    assert pre.interpolation == "bicubic"  # timm's own, not given
    assert main([*args, "--mean", "0.5", "--std", "0.5"]) == 2  # one value for 3 channels
