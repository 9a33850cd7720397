"""Issue 48 item 3, the rough edges a user with their own model meets first, on small random timm
exports as a user would make them: a quantized ViT's head without its zero bias."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from eva0_edge.quant import quantize_model
from eva0_edge.runtime.policy import Policy
from tests.fixtures import uniform_batch


@pytest.fixture(scope="module")
def shift_ready_vit(small_vit, tmp_path_factory):
    """The small random ViT calibrated as `eva0-edge calibrate` does (head_input_mean too)."""
    from eva0_edge.runtime.calibrate import calibrate_with_images

    path = tmp_path_factory.mktemp("shiftvit") / "vit.onnx"
    shutil.copy(small_vit.onnx_path, path)
    images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    return calibrate_with_images(path, images)


@pytest.mark.parametrize("scheme", ["ptq4vit", "int8"])
def test_a_quantized_vit_whose_head_lost_its_zero_bias_shifts(shift_ready_vit, tmp_path, scheme):
    """The export drops the head's all-zero bias (a Gemm without C), ptq4vit writes that as a
    bare MatMul: `--set activation_shift=1` reads it as a zero bias and shifts."""
    out = tmp_path / f"{scheme}.onnx"
    quantize_model(shift_ready_vit, out, 8, uniform_batch(16, seed=5), scheme)
    x = uniform_batch(8, seed=9)
    shifted = Policy.load(out, "noadapt", {"activation_shift": 1.0}, provider="cpu")
    head = shifted.shift.head
    np.testing.assert_array_equal(head.bias, np.zeros(10))
    reference = Policy.load(shift_ready_vit, "noadapt", {"activation_shift": 1.0},
                            provider="cpu").shift.head
    error = np.abs(head.weight - reference.weight)  # the int8 grid, ptq4vit's searched clip
    assert error.mean() <= 0.01 * np.abs(reference.weight).mean()
    logits, features = shifted.session.run(x, np.repeat(shifted.metadata.theta0[None], 8, 0))
    assert head.matches(logits.astype(np.float64), features)  # the file's own logits


def test_serve_logs_the_url_it_listens_on_with_port_0(tmp_path):
    """`serve --port 0` binds any free port and says which, in one line, once listening."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.fixtures import MODEL, NAME

    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "eva0_edge.cli", "serve", "--model", str(MODEL), "--port",
             "0", "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        deadline, found = time.monotonic() + 60, None
        while found is None and time.monotonic() < deadline and process.poll() is None:
            found = re.search(r"listening on (http://127\.0\.0\.1:(\d+)/) \(inference: POST "
                              r"\1v2/models/(\S+)/infer\)", log_path.read_text())
            time.sleep(0.1)
        assert found is not None, log_path.read_text()
        assert int(found.group(2)) > 0 and found.group(3) == NAME
        with urllib.request.urlopen(found.group(1) + "v2/health/ready", timeout=10) as answer:
            assert answer.status == 200  # listening when the line is written
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_quantize_skips_an_undecodable_calibration_image_and_names_it(calibrated_vit, tmp_path,
                                                                        capsys):
    from PIL import Image

    from eva0_edge.cli import main

    folder = tmp_path / "calib"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            folder / f"img_{i}.png")
    (folder / "img_2.png").write_bytes(b"\x89PNG truncated")
    out = tmp_path / "q.onnx"
    assert main(["quantize", "--model", str(calibrated_vit), "--bits", "8", "--scheme", "int8",
                 "--calib", str(folder), "--calib-images", "4", "-o", str(out), "-q"]) == 0
    line = capsys.readouterr().out
    assert "calibrated on 4 images" in line
    assert line.rstrip().endswith(", 1 undecodable input(s) skipped (img_2.png)")
    assert out.is_file()
