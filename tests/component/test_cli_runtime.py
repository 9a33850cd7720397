"""The device CLI end to end: calibrate and adapt over arrays and image folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from eva0_edge.cli import main


def test_a_resumed_adapt_reports_this_runs_counts_and_where_it_resumed(tmp_path, capsys):
    from tests.fixtures import SHIPPED

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


def _adapt_command(stream, out, state) -> list[str]:
    import sys

    from tests.fixtures import SHIPPED
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
    from tests.fixtures import SHIPPED

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
    naming it, the predictions before it (its own batch's included) are published and the state
    is saved."""
    from tests.fixtures import SHIPPED

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
        rows = [json.loads(line)["input"] for line in out.read_text().splitlines()]
        assert rows == [f"img_{i:03d}.png" for i in range(20)]  # its batch's good ones too
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

    from tests.fixtures import SHIPPED
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
    from tests.fixtures import SHIPPED

    assert main(["info", "--model", str(SHIPPED[1])]) == 0
    by_option = capsys.readouterr().out
    assert main(["info", str(SHIPPED[1])]) == 0
    assert capsys.readouterr().out == by_option and "resnet_gn" in by_option
    assert main(["info"]) == 2 and "info takes one model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and __version__ in capsys.readouterr().out
