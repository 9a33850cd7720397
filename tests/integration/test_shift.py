"""Activation shifting for norm-adapted models: the head read from the graph, the shift's
statistic, and the shifted logits against numpy on the head weights (shipped models)."""

from __future__ import annotations

import numpy as np
import onnx

from eva0_edge.runtime.modelfile import load_onnx, read_metadata
from tests.component.test_shift import _initializers


def test_calibrate_writes_the_head_input_mean(small_vit, tmp_path) -> None:
    import shutil

    from eva0_edge.runtime.calibrate import calibrate_with_images
    from eva0_edge.runtime.preprocess import preprocess_uint8
    from eva0_edge.runtime.session import AdaptableSession

    path = tmp_path / "vit.onnx"
    shutil.copyfile(small_vit.onnx_path, path)
    images = np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    calibrate_with_images(path, images, batch_size=16)
    metadata = read_metadata(load_onnx(path))
    session = AdaptableSession(path, metadata, "cpu")
    x = preprocess_uint8(images, metadata.preprocessing)
    _, features = session.run(x, np.broadcast_to(metadata.theta0, (40, metadata.num_params)))
    seg = metadata.feature_layout[-1]
    h = features[:, seg.offset : seg.offset + seg.size].astype(np.float64)
    graph = onnx.load(str(path)).graph
    gather = next(n for n in graph.node if n.output[0] == graph.node[-2].input[0])
    norm = next(n for n in graph.node if n.output[0] == gather.input[0])  # the final LayerNorm
    inits = _initializers(path)
    h = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-6)
    expected = (h * inits[norm.input[1]] + inits[norm.input[2]]).mean(axis=0)
    np.testing.assert_allclose(metadata.arrays["head_input_mean"], expected, atol=1e-5)
