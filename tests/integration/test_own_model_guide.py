"""The guide page "Using your own model" (docs/guide/own-model.md) runs as written: its shell
blocks, in order, in a scratch folder holding the files the page starts from.

Those files are a user's, made here from what the repository has: ``classifier.onnx`` is the
BatchNorm CNN trained in this repository (``models/mobilenet_bn_fmnist.pth``) exported by
``torch.onnx`` (TorchScript, opset 17), ``weights.pth`` a random-initialised timm
``mobilenetv3_small_100`` state dict, ``labels.txt`` Fashion-MNIST's classes, ``clean/`` 1000
and ``val/<class>/`` 300 PNGs of the validation split (never the test split). The only change
made to the blocks is the port: the page's 8000 becomes a free one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.runtime.modelfile import read_metadata
from tests.docblocks import fenced_blocks, run_block, stop
from tests.fixtures import SHIPPED_BN, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "own-model.md"
PORT = "8000"


def _users_files(folder: Path) -> None:
    """The files the page starts from (see the module docstring)."""
    import timm
    import torch

    from eva0_edge.bench.testbed.testbed_archs import ARCHS

    labels = read_metadata(SHIPPED_BN).labels
    model = ARCHS["mobilenet_bn_fmnist"]()
    model.load_state_dict(torch.load(ROOT / "models" / "mobilenet_bn_fmnist.pth",
                                     map_location="cpu", weights_only=True))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation: a user's file
        torch.onnx.export(model.eval(), (torch.zeros(1, 3, 32, 32),),
                          str(folder / "classifier.onnx"), input_names=["input"],
                          output_names=["logits"], dynamic_axes={"input": {0: "batch"}},
                          opset_version=17, dynamo=False)
    torch.manual_seed(0)
    torch.save(timm.create_model("mobilenetv3_small_100", num_classes=10).state_dict(),
               folder / "weights.pth")
    (folder / "labels.txt").write_text("\n".join(labels) + "\n")
    images, targets = corrupted_fmnist("val", "clean", 5, 7)
    (folder / "clean").mkdir()
    for i in range(1000):
        Image.fromarray(images[i]).save(folder / "clean" / f"{i:04d}.png")
    for i in range(1000, 1300):
        cls = folder / "val" / labels[targets[i]].replace("/", "-")
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(cls / f"{i - 1000}.png")
    trouser = np.flatnonzero(targets[:1000] == labels.index("trouser"))[0]
    Image.fromarray(images[trouser]).save(folder / "val" / "trouser" / "0.png")


def test_the_own_model_guide_runs_as_written(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / "bin" / "eva0-edge").exists():
        pytest.skip("the guide needs the tests to run in a venv with eva0-edge installed")
    _users_files(tmp_path)
    port = str(free_port())
    blocks = [re.sub(rf"\b{PORT}\b", port, code)
              for language, code in fenced_blocks(PAGE.read_text()) if language == "bash"]
    assert blocks and any("eva0-edge serve" in code for code in blocks)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", OMP_NUM_THREADS="1")
    log = tmp_path / "serve.log"
    server = None
    outputs = []
    try:
        for code in blocks:
            done = run_block(["bash", "-ec", code], code, tmp_path, env, int(port), log, 900)
            if isinstance(done, subprocess.Popen):
                server = done
                continue
            outputs.append((code, done.stdout + done.stderr))
    finally:
        if server is not None:
            stop(server)
    said = "\n".join(out for _, out in outputs)
    assert "fitted by calibrate on 1000 clean images and 15 corruptions" in said
    timm_file = read_metadata(tmp_path / "mine-timm.onnx")
    assert timm_file.num_classes == 10 and timm_file.preprocessing.mean == (0.2191,) * 3
    quantized = read_metadata(tmp_path / "mine8bit.onnx")
    assert quantized.quantization and quantized.tuned["eva0"]["guard"] is True
    assert quantized.fitted["rates"]["by"] == "tune"
    (asked,) = [out.strip() for code, out in outputs if "adaptation/statistics" in code]
    decoder = json.JSONDecoder()
    answer, end = decoder.raw_decode(asked)
    statistics, _ = decoder.raw_decode(asked[end:].strip())
    assert answer["outputs"][0]["data"] == ["trouser"]
    assert statistics["guard"] is not None and statistics["activation_shift"] is not None
    assert "source-free mode set up in mine-timm.onnx" in said
    assert read_metadata(tmp_path / "mine-timm.onnx").tuned["eva0"]["lambda_swa"] == 0.0
    served = log.read_text()
    assert f"http://127.0.0.1:{port}/" in served and "never fitted" not in served
