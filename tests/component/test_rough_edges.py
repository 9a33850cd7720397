"""Issue 48 item 3, the rough edges a user with their own model meets first, on the shipped
models: the fleet's address, said before it deploys; a state of another model, refused in
words."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest

from eva0_edge.cli import build_parser
from eva0_edge.runtime.state import decode_state
from tests.fixtures import MODEL, NAME


def test_the_fleet_says_its_url_and_binds_a_real_port_for_port_0(monkeypatch, caplog):
    """`serve --replicas 2 --port 0`: the fleet gets a free port by number (Ray Serve's proxy
    binds one) and the log names its URL (the fleet itself is not started here)."""
    pytest.importorskip("ray.serve")
    import eva0_edge.fleet.serve as fleet_serve

    started = {}
    monkeypatch.setattr(fleet_serve, "start_fleet",
                        lambda spec, replicas, config, host, port, *rest, **kw:
                        started.update(host=host, port=port))
    args = build_parser().parse_args(["serve", "--model", str(MODEL), "--replicas", "2",
                                      "--port", "0", "--threads", "1"])
    with caplog.at_level(logging.INFO, logger="eva0_edge"):
        args.func(args)
    assert started["host"] == "127.0.0.1" and started["port"] > 0
    url = f"http://127.0.0.1:{started['port']}/"
    assert re.search(f"will listen on {re.escape(url)} .*v2/models/{NAME}/infer", caplog.text)


# a state of another model: said in words, every way it can differ and every way it is loaded


@pytest.fixture(scope="module")
def shipped_models():
    """The three shipped models under EVA-0, a step into a stream: (ViT, ResNet-GN, BN)."""
    from eva0_edge.runtime.policy import Policy
    from tests.fixtures import SHIPPED, uniform_batch

    models = [Policy.load(path, "eva0", provider="cpu", threads=1) for path in SHIPPED]
    for model in models:
        model.step(uniform_batch(4))
    return models


def _in_words(model) -> str:
    md = model.metadata
    return (f"{md.architecture}: {md.num_params} adapted parameters, {md.num_features} "
            f"features, {md.num_classes} classes")


def _resigned(model, fingerprint: str | None = None, **arrays) -> bytes:
    """``model``'s state with ``arrays`` replaced, re-signed (a valid checksum)."""
    from eva0_edge.runtime.state import encode_state

    state = model.state.copy()
    for name, value in arrays.items():
        setattr(state, name, value)
    return encode_state(state, fingerprint or model.fingerprint, {"method": "eva0"})


@pytest.mark.parametrize("source, target", [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)])
def test_a_state_of_another_shipped_model_is_refused_in_words(shipped_models, tmp_path,
                                                              source, target):
    """Larger or smaller: the same words, naming both models, from bytes and from a file."""
    from eva0_edge.runtime.state import StateError

    other, model = shipped_models[source], shipped_models[target]
    before = model.state_bytes()
    expected = (f"this state is for another model ({_in_words(other)}; saved by eva0), "
                f"not this one ({_in_words(model)})")
    with pytest.raises(StateError) as err:
        model.load_state_bytes(other.state_bytes())
    assert str(err.value) == expected
    path = other.save_state(tmp_path / "other.npz")
    with pytest.raises(StateError) as err:
        model.load_state(path)
    assert str(err.value) == f"{path}: {expected}"
    with pytest.raises(StateError, match="^this state is for another model: state theta"):
        model.load_state_dict(other.state_dict())
    assert model.state_bytes() == before


@pytest.mark.parametrize("change, words", [
    (lambda m: {"theta": np.zeros(m.metadata.num_params + 1, np.float32)},
     "adapted parameters"),
    (lambda m: {"mean": np.zeros(m.metadata.num_features - 1)}, "features"),
    (lambda m: {"center": np.zeros(m.metadata.num_classes + 2)}, "classes"),
    (lambda m: {"fingerprint": "0123456789abcdef"}, "the same sizes, another architecture"),
])
def test_every_way_a_state_can_be_for_another_model_says_so(shipped_models, change, words):
    """Theta, features, classes, or the architecture / theta0 (the fingerprint) at the same
    sizes: each refused as another model's state, the current state untouched."""
    from eva0_edge.runtime.state import StateError

    model = shipped_models[0]
    before = model.state_bytes()
    with pytest.raises(StateError, match="^this state is for another model") as err:
        model.load_state_bytes(_resigned(model, **change(model)))
    assert words in str(err.value) and "not this one" in str(err.value)
    assert model.state_bytes() == before


def test_adapt_refuses_another_models_state_and_keeps_it(shipped_models, tmp_path, capsys):
    from eva0_edge.cli import main
    from tests.fixtures import SHIPPED_VIT

    state = shipped_models[1].save_state(tmp_path / "resnet.npz")
    data = state.read_bytes()
    np.save(tmp_path / "x.npy", np.zeros((4, 32, 32, 3), np.uint8))
    assert main(["adapt", "--model", str(SHIPPED_VIT), "--input", str(tmp_path / "x.npy"),
                 "-o", str(tmp_path / "p.jsonl"), "--state", str(state), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{state}: this state is for another model ({_in_words(shipped_models[1])}" in err
    assert state.read_bytes() == data  # the other model's state is not overwritten


def test_the_server_refuses_another_models_state_in_words(shipped_models):
    from eva0_edge.runtime.server import ServeOptions, create_app
    from tests.fixtures import InProcessServer, http_call

    model = shipped_models[0]
    server = InProcessServer(create_app(model, ServeOptions("vit")))
    try:
        path = "/v2/models/vit/adaptation/state"
        before = http_call(server, "GET", path)
        status, body = http_call(server, "PUT", path, shipped_models[1].state_bytes())
        assert status == 400
        assert "state refused: this state is for another model (" in body.decode()
        assert http_call(server, "GET", path) == before
    finally:
        server.stop()


# --on-bad-input stop: the good images before the bad one, in its batch, are served first


def _folder_with_a_bad_image(root, good_before: int, good_after: int):
    """``root/img_00.png``... : ``good_before`` decodable images, one that is not
    (``img_bad.png`` sorts after them), ``good_after`` more decodable ones (``z_...``)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    root.mkdir()
    for name in [f"img_{i:02d}" for i in range(good_before)] + [
            f"z_{i:02d}" for i in range(good_after)]:
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(root / f"{name}.png")
    (root / "img_bad.png").write_bytes(b"not a png")
    return root


def test_a_stopping_stream_yields_the_good_images_of_its_batch_first(tmp_path):
    from eva0_edge.runtime.data import open_input
    from eva0_edge.runtime.modelfile import read_metadata

    folder = _folder_with_a_bad_image(tmp_path / "in", good_before=5, good_after=2)
    stream = open_input(folder, read_metadata(MODEL).preprocessing)
    batches = stream.batches(4)
    assert next(batches)[0] == [f"img_{i:02d}.png" for i in range(4)]
    assert next(batches)[0] == ["img_04.png"]  # the bad image's batch, up to it
    with pytest.raises(ValueError, match="cannot decode image .*img_bad.png"):
        next(batches)
    skipping = open_input(folder, read_metadata(MODEL).preprocessing)
    names = [name for batch, _, _ in skipping.batches(4, skip_bad=True) for name in batch]
    assert len(names) == 7 and [n for n, _ in skipping.skipped] == ["img_bad.png"]


def test_adapt_on_bad_input_stop_writes_the_good_images_before_it(tmp_path, capsys):
    import json

    from eva0_edge.cli import main

    folder = _folder_with_a_bad_image(tmp_path / "in", good_before=3, good_after=2)
    out = tmp_path / "p.jsonl"
    assert main(["adapt", "--model", str(MODEL), "--input", str(folder), "-o", str(out),
                 "--batch-size", "8", "--on-bad-input", "stop", "-q"]) == 2
    captured = capsys.readouterr()
    assert "cannot decode image" in captured.err and "img_bad.png" in captured.err
    assert "3 samples" in captured.out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["input"] for row in rows] == ["img_00.png", "img_01.png", "img_02.png"]


# bench: an adapting method's row times the session adapt and serve run by default


@pytest.mark.parametrize("command", ["adapt", "serve"])
def test_the_bench_times_the_session_adapt_and_serve_run_by_default(command):
    from eva0_edge.bench.cli import concrete_provider
    from eva0_edge.bench.cost import markdown, resolved_session, run_bench
    from eva0_edge.runtime.cli import method_overrides, session_settings
    from eva0_edge.runtime.methods import load_method

    argv = {"adapt": ["adapt", "--model", str(MODEL), "--input", "x.npy", "-o", "p.jsonl"],
            "serve": ["serve", "--model", str(MODEL)]}[command]
    args = build_parser().parse_args(argv)
    model = load_method(args.model, args.method, method_overrides(args), args.seed,
                        session_settings(args))  # as _cmd_adapt / _cmd_serve load it
    defaults = resolved_session(model.session)
    assert defaults["split"] and not defaults["low_memory"]
    report = run_bench(str(MODEL), [2], ["eva0", "zoa", "eva0-onecall", "eva0-lowmem"],
                       repeats=1, warmup=0, threads=1, memory=False, progress=False,
                       provider=concrete_provider(args.provider))
    sessions = {row["method"]: row["session"] for row in report["rows"]}
    assert sessions["eva0"] == sessions["zoa"] == defaults
    assert sessions["eva0-onecall"] == {**defaults, "split": False}
    assert sessions["eva0-lowmem"]["low_memory"] and not sessions["eva0-lowmem"]["split"]
    assert not sessions["noadapt"]["split"]  # the reference: plain inference, one call
    table = markdown(report)
    assert "| eva0 | 2 |" in table and "| split" in table and "| one call" in table


# quantize skips an undecodable calibration image as adapt does; the loader's record of skipped
# files is shared (calibrate reads it too)


def test_calibration_images_skip_the_undecodable_and_fill_up_from_the_next(tmp_path):
    from eva0_edge.quant.cli import calibration_images
    from eva0_edge.runtime.data import open_input
    from eva0_edge.runtime.modelfile import read_metadata

    folder = _folder_with_a_bad_image(tmp_path / "in", good_before=2, good_after=3)
    stream = open_input(folder, read_metadata(MODEL).preprocessing)
    images = calibration_images(stream, 4)  # files: img_00, img_01, img_bad, z_00, ...
    assert images.shape[0] == 4 and images.dtype == np.float32
    assert stream.skipped_summary() == ", 1 undecodable input(s) skipped (img_bad.png)"
    for _ in range(2):  # another pass over the stream names the file once
        list(stream.batches(3, skip_bad=True))
    assert [name for name, _ in stream.skipped] == ["img_bad.png"]


def test_quantize_fails_clearly_only_when_no_calibration_image_decodes(tmp_path, capsys):
    from eva0_edge.cli import main

    folder = tmp_path / "bad"
    folder.mkdir()
    for name in ("a.png", "b.jpg"):
        (folder / name).write_bytes(b"not an image")
    assert main(["quantize", "--model", str(MODEL), "--bits", "8", "--calib", str(folder),
                 "--calib-images", "2", "-o", str(tmp_path / "q.onnx"), "-q"]) == 2
    err = capsys.readouterr().err
    assert ("--calib: no decodable image among its 2 files, 2 undecodable input(s) skipped "
            "(a.png, b.jpg)") in err
    assert not (tmp_path / "q.onnx").exists()


def _adapted_state(settings: dict) -> bytes:
    """The state of an EVA-0 policy with ``settings`` after three steps on uniform batches."""
    from eva0_edge.runtime.policy import Policy
    from tests.fixtures import SHIPPED_RESNET_GN, uniform_batch

    adapted = Policy.load(SHIPPED_RESNET_GN, "eva0", {"guard": False, **settings}, seed=0,
                          provider="cpu")
    for i in range(3):
        adapted.step(uniform_batch(8, seed=i))
    return adapted.state_bytes()


def _refused_put(policy, data: bytes) -> tuple[str, bytes]:
    """PUT ``data`` as the state of an in-process server around ``policy``: a 400, the
    server's state as it was; (the error, that state's bytes)."""
    from eva0_edge.runtime.server import ServeOptions, create_app
    from tests.fixtures import InProcessServer, http_call

    server = InProcessServer(create_app(policy, ServeOptions("m")))
    try:
        path = "/v2/models/m/adaptation/state"
        before = http_call(server, "GET", path)
        status, body = http_call(server, "PUT", path, data)
        assert status == 400
        assert http_call(server, "GET", path) == before
        return json.loads(body)["error"], before[1]
    finally:
        server.stop()


def test_the_server_refuses_another_methods_state_naming_both():
    """An adapted EVA-0 state PUT into a NoAdapt server is a 400 naming both methods, and the
    server keeps serving theta0 (issue 50: it answered 200 and served adapted parameters); the
    same state loads into an EVA-0 server."""
    from eva0_edge.runtime.policy import Policy
    from tests.fixtures import SHIPPED_RESNET_GN

    data = _adapted_state({})
    noadapt = Policy.load(SHIPPED_RESNET_GN, "noadapt", seed=0, provider="cpu")
    error, _ = _refused_put(noadapt, data)
    assert "written by eva0 (synchronous, no budget), not this server's noadapt" in error
    eva0 = Policy.load(SHIPPED_RESNET_GN, "eva0", {"guard": False}, seed=0, provider="cpu")
    eva0.load_state_bytes(data)
    np.testing.assert_array_equal(eva0.state.theta, decode_state(data)[0].theta)


def test_the_one_forward_tier_refuses_an_adapted_theta_naming_both_uses():
    """An adapted EVA-0 state PUT into `serve --budget 1` (theta0, no guard) is a 400 naming
    both uses, and the server keeps its own state (issue 50 item 2: a state names what decides
    how it is used, and a server refuses one it cannot honour); the tier takes back its own
    state, and an adapting server of either mode and any budget takes the adapted one."""
    from eva0_edge.runtime.policy import Policy
    from tests.fixtures import SHIPPED_RESNET_GN

    data = _adapted_state({})
    tier = Policy.load(SHIPPED_RESNET_GN, "eva0", {"budget": 1.0}, seed=0, provider="cpu")
    error, own = _refused_put(tier, data)
    assert ("theta adapted by eva0 (synchronous, no budget); this server (eva0 "
            "(synchronous, budget 1))") in error
    tier.load_state_bytes(own)  # its own state, back
    for settings, asynchronous in (({"budget": 1.5}, True), ({}, False)):
        adapting = Policy.load(SHIPPED_RESNET_GN, "eva0", {"guard": False, **settings}, seed=0,
                               provider="cpu")
        adapting.set_asynchronous(asynchronous)
        adapting.load_state_bytes(data)
        np.testing.assert_array_equal(adapting.state.theta, decode_state(data)[0].theta)


def test_a_state_dir_another_server_wrote_stops_the_start_and_keeps_its_history(tmp_path):
    """`serve --budget 1 --state-dir D` on a directory of adapted EVA-0 snapshots ends at once
    with a one-line error naming the directory and both uses, and every snapshot is kept
    (issue 50 item 3: a restart never drops a history it wrote; before, every snapshot was
    refused, the server started afresh and its own snapshots pruned the old ones)."""
    import subprocess
    import sys

    from eva0_edge.runtime.server.snapshots import SnapshotStore
    from tests.fixtures import SHIPPED_RESNET_GN

    store = SnapshotStore(tmp_path / "state", keep=3)
    for _ in range(3):
        store.save_bytes(_adapted_state({}))
    before = {p.name: p.read_bytes() for p in (tmp_path / "state").iterdir()}
    run = subprocess.run(
        [sys.executable, "-m", "eva0_edge.cli", "serve", "--model", str(SHIPPED_RESNET_GN),
         "--port", "0", "--threads", "1", "--budget", "1", "--state-dir",
         str(tmp_path / "state")], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    error = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, run.stderr[-2000:]
    assert f"--state-dir {tmp_path / 'state'} holds another server's history" in error[0]
    assert "eva0 (synchronous, no budget)" in error[0] and "budget 1" in error[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "state").iterdir()} == before
