"""Any ONNX classifier in (issue 47): ``make_adaptable`` / ``eva0-edge export --onnx`` on files
from several exporters and families, and the timm families that go through the same rewriter.

The contract on every file: logits at theta0 within 1e-4 of the source file's on 64 inputs,
each theta row changes only its own sample's logits, and the runtime's methods run on it.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from eva0_edge.cli import main
from eva0_edge.exporter.graph import list_affines, make_adaptable
from eva0_edge.runtime.metadata import Preprocessing
from eva0_edge.runtime.modelfile import read_metadata
from tests.fixtures import ServerProcess, run_without_torch
from tests.onnx_sources import ARCHS, images, source_file, timm_model

CASES = [(arch, "dynamo18") for arch in ARCHS] + [
    ("resnet18-gn", "script17"), ("deit_tiny_patch16_224", "script16"),
    ("convnext_atto", "script16"),
    ("resnet18", "script17"), ("convnext_atto", "script17"), ("deit_tiny_patch16_224", "script17"),
    ("mobilenetv3_small_100", "script17"), ("resnet18", "script17-batch1"),
    ("mobilenetv3_small_100", "script17-batch1"), ("resnet18", "ort-basic"),
    ("efficientnet_lite0", "ort-basic"), ("mobilenetv3_small_100", "ort-extended"),
    ("deit_tiny_patch16_224", "ort-extended"), ("convnext_atto", "ort-extended"),
]


def _pre(size: int) -> Preprocessing:
    return Preprocessing((3, size, size), (0.5,) * 3, (0.5,) * 3)


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-sources")


def _source_logits(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    if session.get_inputs()[0].shape[0] == 1:  # a batch-1 file: one image per call
        return np.concatenate([session.run(None, {name: x[i: i + 1]})[0] for i in range(len(x))])
    return session.run(None, {name: x})[0]


@pytest.mark.parametrize("arch,exporter", CASES, ids=[f"{a}-{e}" for a, e in CASES])
def test_adaptable_file_keeps_the_source_logits_and_its_rows_apart(
        sources, tmp_path, arch, exporter):
    size = ARCHS[arch][1]
    source = source_file(sources, arch, exporter)
    out = tmp_path / "adaptable.onnx"
    metadata = make_adaptable(source, out, preprocessing=_pre(size))
    x = images(64, size)
    want = _source_logits(source, x)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    theta0 = metadata.theta0
    got = session.run(["logits"], {"pixel_values": x, "theta": np.tile(theta0, (64, 1))})[0]
    assert np.abs(got - want).max() <= 1e-4
    # r = 2 copies; one row of the second copy perturbed: only its logits move
    theta = np.tile(theta0, (128, 1))
    rng = np.random.default_rng(1)
    theta[64 + 7] += 0.3 * rng.standard_normal(theta0.size).astype(np.float32)
    logits, features = session.run(["logits", "features"], {"pixel_values": x[:64],
                                                             "theta": theta})
    moved = np.abs(logits - np.tile(want, (2, 1))).max(axis=1) > 1e-4
    assert np.flatnonzero(moved).tolist() == [64 + 7]
    assert features.shape == (128, metadata.num_features)


def test_adapt_names_affines_by_index_or_pattern(sources, tmp_path):
    source = source_file(sources, "convnext_atto", "dynamo18")
    listed = list_affines(source)
    assert [name for _, _, name, _ in listed][-1] == "head.norm"
    by_pattern = make_adaptable(source, tmp_path / "a.onnx", adapt="stages.3.*,head.norm",
                                preprocessing=_pre(64))
    names = {s.name.rsplit(".", 1)[0] for s in by_pattern.theta_layout}
    assert names == {n for _, _, n, _ in listed if n.startswith(("stages.3.", "head.norm"))}
    by_index = make_adaptable(source, tmp_path / "b.onnx", adapt=f"{len(listed) - 1}",
                              preprocessing=_pre(64))
    assert [s.name for s in by_index.theta_layout] == ["head.norm.weight", "head.norm.bias"]
    with pytest.raises(ValueError, match="matches none of the"):
        make_adaptable(source, tmp_path / "c.onnx", adapt="blocks.*", preprocessing=_pre(64))


def test_ort_extended_file_splits_fused_conv_around_the_affine(sources, tmp_path):
    source = source_file(sources, "mobilenetv3_small_100", "ort-extended")
    ops = {n.op_type for n in onnx.load(str(source)).graph.node}
    assert "FusedConv" in ops  # the case is real: ORT fused conv + activation
    fused = [i for i, op, _, _ in list_affines(source) if op == "FusedConv"]
    late = fused[len(fused) // 2:]
    out = tmp_path / "a.onnx"
    metadata = make_adaptable(source, out, adapt=",".join(map(str, late)),
                              preprocessing=_pre(64))
    assert len(metadata.theta_layout) == 2 * len(late)
    assert "FusedConv" in {n.op_type for n in onnx.load(str(out)).graph.node}  # the prefix's
    x = images(8, 64)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"pixel_values": x,
                                   "theta": np.tile(metadata.theta0, (8, 1))})[0]
    assert np.abs(got - _source_logits(source, x)).max() <= 1e-4


def test_a_softmax_output_is_dropped_and_the_logits_read(tmp_path):
    import torch

    model = timm_model("resnet18")
    wrapped = torch.nn.Sequential(model, torch.nn.Softmax(dim=1)).eval()
    path = tmp_path / "softmax.onnx"
    torch.onnx.export(wrapped, (torch.randn(1, 3, 64, 64),), str(path), input_names=["x"],
                      dynamic_axes={"x": {0: "b"}}, opset_version=17, dynamo=False)
    metadata = make_adaptable(path, tmp_path / "a.onnx", preprocessing=_pre(64))
    x = images(4, 64)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"pixel_values": x,
                                   "theta": np.tile(metadata.theta0, (4, 1))})[0]
    assert np.abs(got - want).max() <= 1e-4


def _graph_file(tmp_path, nodes, initializers, name="g.onnx", output="y", inputs=None):
    from onnx import TensorProto, helper, numpy_helper

    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_files_it_cannot_adapt_are_refused_with_the_node_named(tmp_path):
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 192)).astype(np.float32)
    no_norm = _graph_file(tmp_path, [
        helper.make_node("Flatten", ["x"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "w"], ["y"], transB=1, name="classifier")], {"w": w})
    with pytest.raises(ValueError, match="no norm or affine layer before the classifier head "
                                         r"\(Gemm node 'classifier'\)"):
        make_adaptable(no_norm, tmp_path / "a.onnx", preprocessing=_pre(8))
    no_head = _graph_file(tmp_path, [helper.make_node("Relu", ["x"], ["y"], name="act")], {},
                          name="nohead.onnx")
    with pytest.raises(ValueError, match="comes from Relu node 'act', not a classifier head"):
        make_adaptable(no_head, tmp_path / "a.onnx", preprocessing=_pre(8))
    dynamic = _graph_file(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], {},
                          name="dyn.onnx", inputs=[helper.make_tensor_value_info(
                              "x", TensorProto.FLOAT, ["N", 3, "H", "W"])])
    with pytest.raises(ValueError, match="has dynamic sizes"):
        make_adaptable(dynamic, tmp_path / "a.onnx")
    with pytest.raises(ValueError, match="not an ONNX model file"):
        (tmp_path / "junk.onnx").write_bytes(b"\x00not a model")
        make_adaptable(tmp_path / "junk.onnx", tmp_path / "a.onnx")
    assert not (tmp_path / "a.onnx").exists()


def test_a_batch_it_cannot_pin_is_refused(tmp_path):
    from onnx import helper

    rng = np.random.default_rng(0)
    initializers = {
        "s": np.ones(3, np.float32), "b": np.zeros(3, np.float32),
        "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32),
        "shape": np.array([2, 192], np.int64),  # a batch of 2, written as a constant
        "w": rng.standard_normal((10, 192)).astype(np.float32),
    }
    path = _graph_file(tmp_path, [
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"]),
        helper.make_node("Reshape", ["n", "shape"], ["f"]),
        helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)], initializers)
    with pytest.raises(ValueError, match="does not run at batch 3"):
        make_adaptable(path, tmp_path / "a.onnx", preprocessing=_pre(8))


def test_the_rewriter_runs_without_torch(sources, tmp_path):
    source = source_file(sources, "regnetx_002", "dynamo18")
    out = tmp_path / "a.onnx"
    result = run_without_torch(f"""
        from eva0_edge.cli import main
        raise SystemExit(main(["export", "--onnx", {str(source)!r}, "-o", {str(out)!r},
                               "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5", "-q"]))
    """)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and read_metadata(out).family == "onnx"


@pytest.fixture(scope="module")
def calibrated(sources, tmp_path_factory):
    """A rewritten MobileNetV3 with source statistics (noadapt-shift and EVA-0's alignment)."""
    from eva0_edge.runtime.calibrate import calibrate_with_images

    folder = tmp_path_factory.mktemp("calibrated")
    out = folder / "mobilenet.onnx"
    main(["export", "--onnx", str(source_file(sources, "mobilenetv3_small_100", "dynamo18")),
          "-o", str(out), "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5", "-q"])
    clean = np.random.default_rng(0).integers(0, 256, (64, 64, 64, 3), dtype=np.uint8)
    calibrate_with_images(out, clean)
    np.save(folder / "stream.npy", clean[:32])
    return out, folder / "stream.npy"


@pytest.mark.parametrize("method", ["eva0", "zoa", "noadapt-shift"])
def test_methods_adapt_a_rewritten_file(calibrated, tmp_path, method):
    model, stream = calibrated
    out = tmp_path / "p.jsonl"
    assert main(["adapt", "--model", str(model), "--input", str(stream), "-o", str(out),
                 "--method", method, "--batch-size", "8", "-q"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 32


def test_a_rewritten_file_serves_and_benches(calibrated, tmp_path):
    import tritonclient.http as httpclient

    model, stream = calibrated
    server = ServerProcess(tmp_path / "serve.log", "--method", "eva0", model=model)
    try:
        x = np.load(stream)[:4].astype(np.float32) / 127.5 - 1.0
        pixels = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        request = httpclient.InferInput("pixel_values", list(pixels.shape), "FP32")
        request.set_data_from_numpy(pixels)
        result = server.client.infer(model.stem, [request])
        assert result.as_numpy("logits").shape == (4, 10)
    finally:
        server.stop()
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(model), "--batch-sizes", "2", "--methods",
                 "eva0,zoa", "--repeats", "1", "--warmup", "1", "--no-memory",
                 "--out", str(out), "-q"]) == 0
    rows = json.loads((out / "cost.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["noadapt", "eva0", "zoa"]


def test_a_shape_read_off_the_input_counts_the_theta_rows(tmp_path):
    """``Reshape(h, Concat(Shape(x)[0], -1))``, as exporters flatten a dynamic batch: the
    adapted rows must not be reshaped to the image count."""
    from onnx import helper

    rng = np.random.default_rng(0)
    initializers = {
        "s": rng.uniform(0.5, 1.5, 3).astype(np.float32),
        "b": rng.normal(0, 0.1, 3).astype(np.float32),
        "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32),
        "zero": np.array([0], np.int64), "minus_one": np.array([-1], np.int64),
        "w": rng.standard_normal((10, 192)).astype(np.float32),
    }
    path = _graph_file(tmp_path, [
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["flat"], axis=0),
        helper.make_node("Reshape", ["r", "flat"], ["f"]),
        helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)], initializers)
    metadata = make_adaptable(path, tmp_path / "a.onnx", preprocessing=_pre(8))
    session = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    x = images(3, 8)
    logits = session.run(["logits"], {"pixel_values": x,
                                      "theta": np.tile(metadata.theta0, (6, 1))})[0]
    assert logits.shape == (6, 10)
    np.testing.assert_allclose(logits[3:], logits[:3], atol=1e-6)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_family_adapts_through_the_runtime(sources, tmp_path, arch):
    """EVA-0, ZOA and noadapt-shift step on every family's rewritten file, calibrated."""
    from eva0_edge.runtime import load_method
    from eva0_edge.runtime.calibrate import calibrate_with_images
    from eva0_edge.runtime.preprocess import preprocess_uint8

    size = ARCHS[arch][1]
    out = tmp_path / "a.onnx"
    make_adaptable(source_file(sources, arch, "dynamo18"), out, preprocessing=_pre(size))
    clean = np.random.default_rng(0).integers(0, 256, (32, size, size, 3), dtype=np.uint8)
    calibrate_with_images(out, clean)
    x = preprocess_uint8(clean[:8], read_metadata(out).preprocessing)
    for method in ("eva0", "zoa", "noadapt-shift"):
        model = load_method(out, method)
        logits = [model.step(x[i: i + 4]) for i in (0, 4)]
        assert all(np.isfinite(lg).all() and lg.shape == (4, 10) for lg in logits)
        if method != "noadapt-shift":
            assert model.stats()["drift"] > 0
