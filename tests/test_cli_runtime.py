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
from tests.test_runtime_no_torch import run_without_torch


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
                 str(tmp_path / "clean.npz"), "-o", str(out), "-q", "--batch-size", "16"]) == 0
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


def test_a_resumed_adapt_reports_this_runs_counts_and_where_it_resumed(tmp_path, capsys):
    from tests.test_testbed import SHIPPED

    rng = np.random.default_rng(2)
    np.savez(tmp_path / "s.npz", x=rng.integers(0, 256, (12, 28, 28), dtype=np.uint8))
    argv = ["adapt", "--model", str(SHIPPED[1]), "--input", str(tmp_path / "s.npz"), "--output",
            str(tmp_path / "p.jsonl"), "--state", str(tmp_path / "state.npz"), "-q",
            "--batch-size", "4"]
    summaries = []
    for _ in range(2):
        assert main(argv) == 0
        summaries.append(capsys.readouterr().out.strip().splitlines()[-1])
    assert "12 samples, 3 steps (0 skipped)," in summaries[0] and "resumed at" not in summaries[0]
    assert "12 samples, 3 steps (0 skipped; resumed at step 3, 6 in the state)," in summaries[1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "missing.npz"], "not found"),
        (["--output", "p.txt"], ".jsonl or .csv"),
        (["--set", "bogus=1"], "unknown hyper-parameter"),
        (["--set", "eta=abc"], "hyper-parameter eta must be float, got 'abc'"),
        (["--set", "guard=1"], "hyper-parameter guard must be bool"),
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


def _adapt_command(stream, out, state) -> list[str]:
    import sys

    from tests.test_testbed import SHIPPED
    return [sys.executable, "-m", "eva0_edge.cli", "adapt", "--model", str(SHIPPED[1]),
            "--input", str(stream), "--output", str(out), "--state", str(state),
            "--batch-size", "16", "-q"]


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_interrupted_adapt_keeps_the_predictions_and_the_state(tmp_path, signal_name):
    """A signal mid-stream: the batch in progress finishes, the predictions of every batch done
    are published (whole JSON lines, no .partial), the state is saved and loads, exit 130."""
    import signal
    import subprocess
    import time

    from eva0_edge.runtime.policy import Policy
    from tests.test_testbed import SHIPPED

    stream, out, state = tmp_path / "x.npy", tmp_path / "p.jsonl", tmp_path / "s.npz"
    np.save(stream, np.random.default_rng(0).integers(0, 256, (20000, 32, 32, 3), np.uint8))
    proc = subprocess.Popen(_adapt_command(stream, out, state), stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    partial = tmp_path / "p.jsonl.partial"
    deadline = time.monotonic() + 120
    while (not partial.exists() or partial.stat().st_size < 10000) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signal_name))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and f"stopped by {signal_name}" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(rows) < 20000 and len(rows) % 16 == 0
    assert not partial.exists()
    model = Policy.load(SHIPPED[1], "eva0")
    model.load_state(state)
    assert 0 < model.state.step <= len(rows) // 16  # paused batches (the guard) take no step


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_bad_image_mid_stream_is_skipped_or_stops_keeping_what_was_done(tmp_path, capsys,
                                                                         mode):
    """An undecodable file in an image folder. skip (the default): the run finishes, 47
    predictions, the file named in the summary. stop: the run stops there with one line
    naming it, the predictions before it are published and the state is saved."""
    from tests.test_testbed import SHIPPED

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(48):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            folder / f"img_{i:03d}.png")
    (folder / "img_020.png").write_bytes(b"\x89PNG not really")
    out, state = tmp_path / "p.jsonl", tmp_path / "s.npz"
    argv = ["adapt", "--model", str(SHIPPED[1]), "--input", str(folder), "--output", str(out),
            "--state", str(state), "--batch-size", "16", "--on-bad-input", mode, "-q"]
    if mode == "skip":
        assert main(argv) == 0
        assert "1 undecodable input(s) skipped (img_020.png)" in capsys.readouterr().out
        rows = [json.loads(line)["input"] for line in out.read_text().splitlines()]
        assert len(rows) == 47 and "img_020.png" not in rows
    else:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "img_020.png" in err and "Traceback" not in err
        assert len(out.read_text().splitlines()) == 16
    assert state.is_file() and not (tmp_path / "p.jsonl.partial").exists()


@pytest.mark.parametrize("argv,option", [
    (["serve", "--model", "m.onnx", "--port", "99999"], "--port"),
    (["serve", "--model", "m.onnx", "--port", "-1"], "--port"),
    (["serve", "--model", "m.onnx", "--threads", "-1"], "--threads"),
    (["eval", "--model", "m.onnx", "--limit", "0"], "--limit"),
    (["eval", "--model", "m.onnx", "--limit", "-5"], "--limit"),
    (["eval", "--model", "m.onnx", "--batch-sizes", "1,-1"], "--batch-sizes"),
    (["bench", "--model", "m.onnx", "--repeats", "0"], "--repeats"),
    (["bench", "--model", "m.onnx", "--batch-sizes", "x"], "--batch-sizes"),
    (["adapt", "--model", "m.onnx", "--input", "x", "--output", "p.jsonl", "--batch-size", "0"],
     "--batch-size"),
])
def test_values_that_mean_nothing_are_usage_errors_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "Traceback" not in err


def test_a_closed_pipe_and_an_unexpected_error_end_in_one_line(tmp_path):
    """`info | true`: no BrokenPipeError traceback; an unexpected error: one line and a hint."""
    import subprocess
    import sys

    from tests.test_testbed import SHIPPED
    piped = subprocess.run(
        f"{sys.executable} -m eva0_edge.cli info {SHIPPED[1]} | true", shell=True,
        capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "Traceback" not in piped.stderr
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    failed = subprocess.run([sys.executable, "-m", "eva0_edge.cli", "info", str(empty)],
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode in (1, 2) and "Traceback" not in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1


def test_info_takes_the_model_as_every_command_does_and_the_version_is_shown(capsys):
    from eva0_edge import __version__
    from tests.test_testbed import SHIPPED

    assert main(["info", "--model", str(SHIPPED[1])]) == 0
    by_option = capsys.readouterr().out
    assert main(["info", str(SHIPPED[1])]) == 0
    assert capsys.readouterr().out == by_option and "resnet_gn" in by_option
    assert main(["info"]) == 2 and "info takes one model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and __version__ in capsys.readouterr().out
