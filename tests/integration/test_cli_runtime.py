"""The device CLI end to end: calibrate and adapt over arrays and image folders."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

from eva0_edge.cli import main
from eva0_edge.runtime.calibrate import feature_statistics
from eva0_edge.runtime.data import open_input
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.session import AdaptableSession
from tests.fixtures import run_without_torch


@pytest.fixture()
def image_folder(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "images"
    (folder / "b").mkdir(parents=True)
    names = ["b/img_002.png", "img_010.png", "img_001.jpg", "b/img_001.png"]
    for i, name in enumerate(names):
        size = (32, 32) if i % 2 == 0 else (40, 48)  # resized + cropped per metadata
        pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_calibrate_writes_feature_statistics(small_vit, tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "clean.npz", images=images)
    out = tmp_path / "cal.onnx"
    assert main(["calibrate", "--model", str(small_vit.onnx_path), "--data",
                 str(tmp_path / "clean.npz"), "-o", str(out), "-q", "--batch-size", "16",
                 "--no-fit"]) == 0
    metadata = read_metadata(out)
    assert metadata.has_source_stats
    session = AdaptableSession(small_vit.onnx_path, metadata, "cpu")
    _, x, _ = next(open_input(tmp_path / "clean.npz", metadata.preprocessing).batches(40))
    _, features = session.run(x, np.tile(metadata.theta0, (40, 1)))
    np.testing.assert_allclose(metadata.arrays["source_mean"], features.mean(0), atol=1e-5)
    np.testing.assert_allclose(metadata.arrays["source_std"], features.std(0), atol=1e-4)
    again, _ = feature_statistics(session, open_input(tmp_path / "clean.npz",
                                                      metadata.preprocessing), 7, False)
    np.testing.assert_allclose(again, metadata.arrays["source_mean"], atol=1e-5)


def test_adapt_image_folder_in_sorted_order(calibrated_vit, image_folder, tmp_path):
    out = tmp_path / "preds.jsonl"
    state = tmp_path / "state.npz"
    args = ["adapt", "--model", str(calibrated_vit), "--input", str(image_folder),
            "--output", str(out), "--batch-size", "3", "--state", str(state), "-q", "--logits"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input"] for r in rows] == [
        "b/img_001.png", "b/img_002.png", "img_001.jpg", "img_010.png"
    ]
    for row in rows:
        assert row["label"] == int(np.argmax(row["logits"]))
        assert row["class"] == f"class_{row['label']}"
    assert state.is_file()
    assert main(args) == 0  # resumes from the state
    from eva0_edge.runtime.state import read_state_file

    resumed, info = read_state_file(state)
    assert resumed.step == 4 and info["method"] == "eva0"


def test_adapt_npz_with_labels_to_csv(calibrated_vit, tmp_path, capsys):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "s.npz", x=rng.integers(0, 256, (10, 32, 32), dtype=np.uint8),
             y=rng.integers(0, 10, 10))
    out = tmp_path / "preds.csv"
    assert main(["adapt", "--model", str(calibrated_vit), "--input", str(tmp_path / "s.npz"),
                 "--output", str(out), "--method", "zoa", "-q", "--batch-size", "4"]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and rows[0]["input"] == "0" and rows[0]["true_label"] != ""
    assert "accuracy" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "missing.npz"], "not found"),
        (["--output", "p.txt"], ".jsonl or .csv"),
        (["--set", "bogus=1"], "unknown hyper-parameter"),
        (["--set", "eta=abc"], "hyper-parameter eta must be a number, got 'abc'"),
        (["--set", "guard=2"], "hyper-parameter guard must be a boolean"),
    ],
)
def test_adapt_bad_arguments_exit_2(calibrated_vit, tmp_path, capsys, args, message):
    np.save(tmp_path / "ok.npy", np.zeros((2, 32, 32, 3), np.uint8))
    base = {"--model": str(calibrated_vit), "--input": str(tmp_path / "ok.npy"),
            "--output": str(tmp_path / "p.jsonl")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["adapt", *[v for kv in base.items() for v in kv], "-q"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.npy"]  # no output, no .partial


def test_adapt_runs_without_torch(calibrated_vit, image_folder, tmp_path):
    out = tmp_path / "p.jsonl"
    result = run_without_torch(
        f"""
        from eva0_edge.cli import main
        assert main(["adapt", "--model", {str(calibrated_vit)!r}, "--input",
                     {str(image_folder)!r}, "--output", {str(out)!r}, "-q"]) == 0
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().splitlines()) == 4


def test_adapt_streams_foa_over_a_prompt_model(prompt_vit, tmp_path, capsys):
    """FOA (here with 5 candidates) runs in adapt like the EVA-0 family, --budget included; its
    CMA-ES state is not persisted, so --state is refused before any work."""
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "s.npz", x=rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8),
             y=rng.integers(0, 10, 6))
    out = tmp_path / "preds.jsonl"
    base = ["adapt", "--model", str(prompt_vit.onnx_path), "--input", str(tmp_path / "s.npz"),
            "--output", str(out), "--method", "foa@5", "--batch-size", "3", "-q"]
    assert main(base) == 0
    assert len(out.read_text().splitlines()) == 6
    assert "foa@5: 6 samples, 2 steps" in capsys.readouterr().out
    assert main([*base, "--budget", "1"]) == 0  # the compute budget: no search at all
    assert "foa@5: 6 samples, 0 steps (0 skipped), 1.00 forwards/sample" in capsys.readouterr().out
    assert main([*base, "--state", str(tmp_path / "foa.npz")]) == 2
    assert "CMA-ES" in capsys.readouterr().err
    assert not (tmp_path / "foa.npz").exists()


def test_adapt_with_split_sessions_writes_the_same_predictions(calibrated_vit, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("EVA0_CACHE", str(tmp_path / "cache"))
    np.save(tmp_path / "s.npy", np.random.default_rng(2).integers(0, 256, (12, 32, 32, 3),
                                                                  dtype=np.uint8))
    outputs = {}
    for mode, extra in (("whole", []), ("split", ["--split-sessions"]),
                        ("budget", ["--split-sessions", "--memory-budget-mb", "512"])):
        outputs[mode] = tmp_path / f"{mode}.jsonl"
        assert main(["adapt", "--model", str(calibrated_vit), "--input", str(tmp_path / "s.npy"),
                     "--output", str(outputs[mode]), "--batch-size", "4", "-q", *extra]) == 0
    labels = {mode: [json.loads(line)["label"] for line in path.read_text().splitlines()]
              for mode, path in outputs.items()}
    assert labels["split"] == labels["whole"] == labels["budget"]
