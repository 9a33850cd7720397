"""The source-free mode (issue 48 item 2): the source-free activation shift's offset, its wiring
into eva0-dagger and into eva0 on a file without source statistics, and ``setup_source_free``
(shipped models, stripped of their source statistics in a temporary folder)."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.head import HeadError, LinearHead
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.registry import REGISTRY, SOURCE_FREE_SHIFT
from eva0_edge.runtime.shift import ActivationShift, SourceFreeShift
from eva0_edge.runtime.sourcefree import (
    SOURCE_ARRAYS,
    drop_source_free_eva0,
    setup_source_free,
    strip_source_statistics,
)
from eva0_edge.runtime.state import AdaptState
from tests.fixtures import SHIPPED, SHIPPED_RESNET_GN, uniform_batch


def _head(width: int = 4, classes: int = 3) -> LinearHead:
    rng = np.random.default_rng(5)
    return LinearHead(rng.normal(size=(classes, width)), rng.normal(size=classes),
                      slice(0, width))


def _state(head: LinearHead) -> AdaptState:
    return AdaptState.initial(np.zeros(2), head.bias.size, head.width, 0)


def test_the_offset_makes_the_window_mean_logit_equal_across_classes() -> None:
    head = _head()
    shift = SourceFreeShift(head, strength=1.0, window=256.0)
    state = _state(head)
    rows = np.random.default_rng(1).normal(loc=2.0, size=(300, head.width))
    shift.observe(state, rows)
    mean_logit = head.weight @ state.shift_mean + head.bias
    moved = mean_logit + shift.offset(state)
    np.testing.assert_allclose(moved, moved.mean(), atol=1e-12)  # balanced
    assert np.ptp(mean_logit) > 1.0  # it was not balanced before
    twice = SourceFreeShift(head, strength=2.0, window=256.0)
    np.testing.assert_allclose(twice.offset(state), 2.0 * shift.offset(state))


def test_the_offset_waits_for_a_window_and_ignores_a_stream_without_spread() -> None:
    head = _head()
    shift = SourceFreeShift(head, strength=1.0, window=256.0)
    state = _state(head)
    rows = np.random.default_rng(2).normal(loc=2.0, size=(40, head.width))
    shift.observe(state, rows[:8])  # 8 samples: under the 32 a window is served from
    assert not shift.offset(state).any()
    state = _state(head)
    shift.observe(state, np.repeat(rows[:1], 64, axis=0))  # one image repeated
    assert not shift.offset(state).any()


@pytest.fixture(scope="module")
def stripped(tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("source-free")
    return {p.stem: strip_source_statistics(p, folder / p.name) for p in SHIPPED}


def test_a_stripped_copy_has_no_source_statistics_and_no_calibrated_shift(stripped) -> None:
    for path in stripped.values():
        md = read_metadata(path)
        assert not md.has_source_stats and not set(SOURCE_ARRAYS) & set(md.arrays)
        assert "activation_shift" not in md.tuned.get("eva0", {})
        assert not any(k.startswith("guard_") for k in md.recommended)


def test_eva0_dagger_serves_the_source_free_shift_on_a_file_without_source_statistics(
    stripped,
) -> None:
    assert {k: REGISTRY["eva0-dagger"].overrides[k] for k in SOURCE_FREE_SHIFT} == \
        SOURCE_FREE_SHIFT
    path = stripped["resnet_gn_fmnist"]
    model = Policy.load(path, "eva0-dagger", provider="cpu", threads=1)
    assert isinstance(model.shift, SourceFreeShift)
    assert model.config.lambda_swa == 0 and model.config.free_shift > 0
    reference = Policy.load(path, "noadapt", provider="cpu", threads=1)
    assert reference.shift is None
    x = uniform_batch(64, seed=4)
    for start in range(0, 64, 16):  # the shift serves once its window holds 32 samples
        model.step(x[start : start + 16])
    assert model.shift.offset(model.state).any()
    # the served logits are the model's own, moved by the offset (no forward)
    theta = np.broadcast_to(model.state.theta, (8, model.state.theta.size))
    logits, _ = model.session.run(x[:8], theta)
    served = model.predict(x[:8])
    np.testing.assert_allclose(served, logits + model.shift.offset(model.state), rtol=0,
                               atol=1e-5)
    paper = Policy.load(path, "eva0-dagger", {"free_shift": 0.0}, provider="cpu", threads=1)
    assert paper.shift is None  # the paper's EVA-0-dagger, entropy only


def test_the_calibrated_methods_keep_the_source_shift(stripped) -> None:
    model = Policy.load(SHIPPED_RESNET_GN, "eva0", provider="cpu", threads=1)
    assert type(model.shift) is ActivationShift  # eva0 on a calibrated file: unchanged
    both = Policy.load(SHIPPED_RESNET_GN, "noadapt",
                       {"activation_shift": 1.0, "free_shift": 2.0}, provider="cpu")
    assert type(both.shift) is ActivationShift  # the source shift wins where it can run
    with pytest.raises(ValueError, match="free_shift >= 0"):
        Policy.load(SHIPPED_RESNET_GN, "noadapt", {"free_shift": -1.0}, provider="cpu")


def test_setup_writes_the_source_free_mode_and_eva0_runs_it(stripped, tmp_path) -> None:
    path = stripped["mobilenet_bn_fmnist"]
    out = tmp_path / "set-up.onnx"
    line = setup_source_free(path, out)
    assert line.startswith(f"source-free mode set up in {out} for eva0-dagger and eva0")
    assert "no clean images used" in line
    md = read_metadata(out)
    for method in ("eva0-dagger", "eva0"):
        assert md.tuned[method]["free_shift"] > 0
        assert md.tuned[method]["shift_window"] == SOURCE_FREE_SHIFT["shift_window"]
    assert md.tuned["eva0"]["lambda_swa"] == 0.0
    assert md.fitted["source-free"]["by"] == "setup_source_free"
    model = Policy.load(out, "eva0", provider="cpu", threads=1)  # the default method
    assert isinstance(model.shift, SourceFreeShift) and model.config.lambda_swa == 0


def test_setup_keeps_tuned_values_and_leaves_calibrated_eva0_alone(stripped, tmp_path) -> None:
    out = tmp_path / "vit.onnx"
    setup_source_free(stripped["vit_fmnist"], out)
    tuned = read_metadata(SHIPPED[0]).tuned.get("eva0-dagger", {})
    for key in ("eta", "free_shift", "shift_window"):
        if key in tuned:
            assert read_metadata(out).tuned["eva0-dagger"][key] == tuned[key]
    calibrated = tmp_path / "calibrated.onnx"
    line = setup_source_free(SHIPPED_RESNET_GN, calibrated)
    assert " for eva0-dagger:" in line
    assert read_metadata(calibrated).tuned["eva0"] == read_metadata(SHIPPED_RESNET_GN).tuned["eva0"]


def test_setup_says_when_the_head_cannot_be_shifted(stripped, tmp_path, monkeypatch) -> None:
    def unreadable(*_args, **_kwargs):
        raise HeadError("the graph has no 'logits' output")

    monkeypatch.setattr("eva0_edge.runtime.sourcefree.load_free_shift", unreadable)
    line = setup_source_free(stripped["resnet_gn_fmnist"], tmp_path / "plain.onnx")
    assert "without the source-free shift (entropy only)" in line
    assert read_metadata(tmp_path / "plain.onnx").tuned["eva0-dagger"]["free_shift"] == 0.0


def test_calibrating_a_set_up_file_gives_eva0_back_its_source_terms(stripped, tmp_path) -> None:
    out = tmp_path / "set-up.onnx"
    setup_source_free(stripped["resnet_gn_fmnist"], out)
    md = drop_source_free_eva0(read_metadata(out))
    assert not {"lambda_swa", *SOURCE_FREE_SHIFT} & set(md.tuned["eva0"])
    assert md.tuned["eva0-dagger"]["free_shift"] > 0
    assert md.fitted["source-free"]["methods"] == ["eva0-dagger"]
