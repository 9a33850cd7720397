"""Activation shifting for norm-adapted models: the head read from the graph, the shift's
statistic, and the shifted logits against numpy on the head weights (shipped models)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from eva0_edge.runtime.head import LinearHead
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.shift import ActivationShift
from eva0_edge.runtime.state import AdaptState, decode_state, encode_state
from tests.fixtures import SHIPPED, uniform_batch

# the shipped files' classifier and final LayerNorm, by their initializer names
HEAD_NAMES = {
    "resnet_gn_fmnist": ("model.fc.weight", "model.fc.bias", None),
    "vit_fmnist": ("model.head.weight", "model.head.bias", "model.norm"),
    "mobilenet_bn_fmnist": ("classifier.weight", "classifier.bias", None),  # graph rewriter's
}


def _initializers(path) -> dict[str, np.ndarray]:
    graph = onnx.load(str(path)).graph
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in graph.initializer}


def _numpy_head_input(path, features: np.ndarray) -> np.ndarray:
    """The head input computed independently: the last feature segment, layer-normalised with
    the graph's final LayerNorm for the ViT (epsilon 1e-6, timm's)."""
    metadata = read_metadata(path)
    seg = metadata.feature_layout[-1]
    h = features[:, seg.offset : seg.offset + seg.size].astype(np.float64)
    norm = HEAD_NAMES[path.stem][2]
    if norm is None:
        return h
    inits = _initializers(path)
    mu = h.mean(axis=1, keepdims=True)
    var = h.var(axis=1, keepdims=True)
    return (h - mu) / np.sqrt(var + 1e-6) * inits[f"{norm}.weight"] + inits[f"{norm}.bias"]


@pytest.fixture(params=SHIPPED, ids=lambda p: p.stem)
def shipped(request):
    return request.param


def test_head_read_from_the_graph_is_the_classifier(shipped) -> None:
    model = Policy.load(shipped, "eva0", {"activation_shift": 1.0}, provider="cpu")
    head = model.shift.head
    weight, bias, _ = HEAD_NAMES[shipped.stem]
    inits = _initializers(shipped)
    np.testing.assert_array_equal(head.weight, inits[weight])
    np.testing.assert_array_equal(head.bias, inits[bias])
    x = uniform_batch(8, seed=3)
    theta = np.broadcast_to(model.state.theta, (8, model.state.theta.size))
    logits, features = model.session.run(x, theta)
    np.testing.assert_allclose(head.head_input(features), _numpy_head_input(shipped, features),
                               rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(head.logits(features), logits, atol=1e-4)


def test_shifted_logits_are_the_head_on_shifted_features(shipped) -> None:
    model = Policy.load(shipped, "eva0", {"activation_shift": 0.7}, provider="cpu")
    head = model.shift.head
    rng = np.random.default_rng(1)
    test_mean = model.shift.source_mean + rng.normal(0, 0.3, head.width)
    model.state.shift_mean, model.state.shift_weight = test_mean, 0.99
    model.state.shift_sq = float(test_mean @ test_mean) + 10.0  # a stream with variance
    x = uniform_batch(6, seed=4)
    served = model.predict(x)
    _, features = model.session.run(x, np.broadcast_to(model.state.theta,
                                                       (6, model.state.theta.size)))
    factor = js_factor(model.state, model.shift.source_mean, model.config.shift_window)
    assert 0.5 < factor < 1  # a gap of 0.3 per feature against a small noise: mostly kept
    moved = _numpy_head_input(shipped, features) + 0.7 * factor * (
        model.shift.source_mean - test_mean
    )
    weight, bias, _ = HEAD_NAMES[shipped.stem]
    inits = _initializers(shipped)
    np.testing.assert_allclose(served, moved @ inits[weight].T + inits[bias], atol=1e-4)
    assert model.state.shift_weight == 0.99  # predict serves, it does not learn


def test_zero_shift_leaves_logits_unchanged(shipped) -> None:
    shifted = Policy.load(shipped, "eva0", {"activation_shift": 1.0}, provider="cpu")
    plain = Policy.load(shipped, "eva0", provider="cpu")
    x = uniform_batch(16, seed=5)
    np.testing.assert_array_equal(shifted.step(x), plain.step(x))  # nothing seen yet: no shift
    shifted.state.shift_mean = shifted.shift.source_mean.copy()  # test mean = source mean
    np.testing.assert_allclose(shifted.predict(x), plain.predict(x), atol=1e-6)


def js_factor(state: AdaptState, source: np.ndarray, window: float) -> float:
    """The James-Stein factor by hand: 1 - (variance / effective count) / ||gap||^2, >= 0."""
    a = 1 - 2 / (window + 1)
    w = state.shift_weight
    samples = np.log(1 - w) / np.log(a)  # the window's sample count n: w = 1 - a^n
    weights = (1 - a) * a ** np.arange(int(round(samples))) / w
    variance = state.shift_sq - state.shift_mean @ state.shift_mean
    gap = source - state.shift_mean
    return max(0.0, 1 - variance * float((weights**2).sum()) / float(gap @ gap))


def _empty_state() -> AdaptState:
    return AdaptState.initial(np.zeros(1, dtype=np.float32), 3, 9, 0)


def _wide_state(width: int) -> AdaptState:
    return AdaptState.initial(np.zeros(1, dtype=np.float32), 3, width, 0)


def test_shift_is_source_mean_minus_windowed_test_mean() -> None:
    rng = np.random.default_rng(0)
    width, classes, window = 5, 3, 40.0
    head = LinearHead(rng.normal(size=(classes, width)), rng.normal(size=classes), slice(2, 7))
    source = rng.normal(size=width)
    shift = ActivationShift(head, source, strength=1.0, window=window)
    features = rng.normal(2.0, 1.0, (40, 9))  # more than the 32 a window needs to be served
    one_batch, one_by_one = _empty_state(), _empty_state()
    shift.observe(one_batch, features)
    for row in features:  # the same samples one per batch
        shift.observe(one_by_one, row[None])
    np.testing.assert_allclose(one_by_one.shift_mean, one_batch.shift_mean, rtol=1e-12)
    assert one_by_one.shift_weight == pytest.approx(one_batch.shift_weight)
    a = 1 - 2 / (window + 1)  # the bias-corrected EMA by hand
    raw = np.zeros(width)
    for row in features[:, 2:7]:
        raw = a * raw + (1 - a) * row
    np.testing.assert_allclose(one_batch.shift_mean, raw / (1 - a ** len(features)), rtol=1e-12)
    factor = js_factor(one_batch, source, window)
    np.testing.assert_allclose(shift.offset(one_batch),
                               head.weight @ (factor * (source - one_batch.shift_mean)))
    assert shift.changes == 0
    shift.restart(one_batch)
    np.testing.assert_array_equal(shift.offset(one_batch), np.zeros(classes))


def test_a_change_of_stream_restarts_the_window_from_the_recent_samples() -> None:
    rng = np.random.default_rng(3)
    head = LinearHead(rng.normal(size=(3, 4)), np.zeros(3), slice(0, 4))
    shift = ActivationShift(head, np.zeros(4), strength=1.0, window=256.0)
    state = _empty_state()
    for _ in range(300):  # black frames: one constant head input
        shift.observe(state, np.full((1, 4), 4.0))
    for _ in range(200):  # the same stream, noisy: no change
        shift.observe(state, rng.normal(0.0, 1.0, (1, 4)) + (4.0 if shift.changes else 0.0))
        if shift.changes:
            break
    assert shift.changes == 1  # the first noisy sample is a change from zero variance
    changes = shift.changes
    for _ in range(1000):
        shift.observe(state, rng.normal(4.0, 1.0, (1, 4)))
    assert shift.changes == changes  # a steady stream does not look like a change
    for _ in range(64):  # another stream: followed within tens of samples, not 256
        shift.observe(state, rng.normal(0.0, 1.0, (1, 4)))
    assert shift.changes > changes and np.linalg.norm(state.shift_mean) < 1.0


def test_noadapt_shift_learns_the_stream_at_one_forward() -> None:
    resnet = SHIPPED[1]
    # uniform noise is far past the shift bound fitted for eva0, which noadapt-shift takes
    shifted = Policy.load(resnet, "noadapt-shift", {"shift_max": None}, provider="cpu")
    plain = Policy.load(resnet, "noadapt", provider="cpu")
    x = uniform_batch(64, seed=6)
    for i in range(0, 64, 16):  # served once 32 samples are in the window
        out, ref = shifted.step(x[i : i + 16]), plain.step(x[i : i + 16])
        assert (i < 32) == np.array_equal(out, ref)
    assert shifted.stats()["forwards_per_sample"] == 1.0
    assert shifted.state.shift_weight > 0 and shifted.state.step == 0
    shifted.freeze()
    before = shifted.state.shift_mean.copy()
    shifted.step(x[:8])
    np.testing.assert_array_equal(shifted.state.shift_mean, before)


def test_state_keeps_the_shift_and_older_states_load(shipped) -> None:
    model = Policy.load(shipped, "eva0", {"activation_shift": 1.0}, provider="cpu")
    x = uniform_batch(32, seed=7)
    model.step(x[:16])
    again = Policy.load(shipped, "eva0", {"activation_shift": 1.0}, provider="cpu")
    again.load_state_bytes(model.state_bytes())
    np.testing.assert_array_equal(again.state.shift_mean, model.state.shift_mean)
    np.testing.assert_array_equal(again.step(x[16:]), model.step(x[16:]))
    state = AdaptState.initial(model.metadata.theta0, model.metadata.num_classes,
                               model.metadata.num_features, 0)
    data = encode_state(state, model.fingerprint, {})
    values, _ = decode_state(data)
    older = {k: v for k, v in values.to_dict().items() if not k.startswith("shift_")}
    restored = AdaptState.from_dict(older)
    assert restored.shift_mean.size == 0 and restored.shift_weight == 0.0
    again.load_state_dict(older)
    again.step(x[:8])
    assert again.state.shift_mean.shape == (model.shift.head.width,)


def test_a_stream_beyond_the_bound_restarts_the_window_unshifted() -> None:
    rng = np.random.default_rng(2)
    head = LinearHead(rng.normal(size=(3, 4)), np.zeros(3), slice(0, 4))
    source = np.zeros(4)
    shift = ActivationShift(head, source, strength=1.0, window=256.0, max_distance=1.0)
    state = _empty_state()
    for _ in range(100):  # far from the source: never served, restarted once checkable
        shift.observe(state, rng.normal(5.0, 0.1, (1, 4)))
        assert not shift.offset(state).any()
    assert shift.restarts >= 1
    for _ in range(160):  # near: served once the window holds 64 samples
        shift.observe(state, rng.normal(0.3, 0.1, (1, 4)))
        served = shift.offset(state)
        assert served.any() == (state.shift_weight >= shift.checked_weight)
    assert served.any()
    factor = js_factor(state, source, 256.0)
    assert factor > 0.9  # a gap of 0.3 per feature, noise 0.1 per sample: shifted in full
    np.testing.assert_allclose(served, head.weight @ (factor * (source - state.shift_mean)))
    assert np.linalg.norm(state.shift_mean - 0.3) < 0.1


def test_a_stream_from_the_source_distribution_is_barely_shifted() -> None:
    """Clean images: the window's gap to the source mean is its own sampling noise, and the
    James-Stein factor shrinks the shift toward zero; a corruption's gap is kept."""
    rng = np.random.default_rng(5)
    width = 64
    head = LinearHead(rng.normal(size=(3, width)), np.zeros(3), slice(0, width))
    source = np.zeros(width)
    shift = ActivationShift(head, source, strength=2.0, window=256.0)
    clean, corrupted = _wide_state(width), _wide_state(width)
    factors = []
    for _ in range(600):
        shift.observe(clean, rng.normal(0.0, 1.0, (1, width)))
        shift.observe(corrupted, rng.normal(0.5, 1.0, (1, width)))
        if clean.shift_weight >= shift.checked_weight:
            factors.append(js_factor(clean, source, 256.0))
    served_clean = np.linalg.norm(shift.offset(clean))
    unshrunk_clean = np.linalg.norm(head.weight @ (2.0 * (source - clean.shift_mean)))
    assert served_clean <= 0.5 * unshrunk_clean and np.mean(factors) < 0.5
    assert js_factor(corrupted, source, 256.0) > 0.9


def test_one_image_repeated_is_not_shifted() -> None:
    rng = np.random.default_rng(4)
    head = LinearHead(rng.normal(size=(3, 4)), np.zeros(3), slice(0, 4))
    shift = ActivationShift(head, np.zeros(4), strength=1.0, window=64.0)
    state = _empty_state()
    image = rng.normal(2.0, 1.0, (1, 4))
    for _ in range(100):
        shift.observe(state, image)
    assert state.shift_weight > 0.9 and not shift.offset(state).any()
    for _ in range(100):
        shift.observe(state, rng.normal(2.0, 1.0, (1, 4)))
    assert shift.offset(state).any()


def test_a_stream_without_spread_is_degenerate_once_the_recent_window_is_full() -> None:
    rng = np.random.default_rng(6)
    head = LinearHead(rng.normal(size=(3, 4)), np.zeros(3), slice(0, 4))
    shift = ActivationShift(head, np.zeros(4), strength=1.0, window=256.0)
    repeated, varied = _empty_state(), _empty_state()
    assert not shift.degenerate(repeated)  # nothing seen
    image = rng.normal(2.0, 1.0, (1, 4))
    for i in range(40):
        shift.observe(repeated, image)
        shift.observe(varied, rng.normal(2.0, 1.0, (1, 4)))
        if i < 30:  # the recent window is not full yet
            assert not shift.degenerate(repeated)
    assert shift.degenerate(repeated) and not shift.degenerate(varied)
    low = _empty_state()  # a variance share just above / below MIN_SPREAD (5%)
    for share, expected in ((0.06, False), (0.04, True)):
        low.shift_recent, low.shift_recent_weight = np.array([1.0, 0.0]), 1.0
        low.shift_recent_sq = 1.0 / (1.0 - share)  # variance = share x mean square
        assert shift.degenerate(low) == expected


def _line_head(width: int = 2) -> LinearHead:
    return LinearHead(np.random.default_rng(8).normal(size=(3, width)), np.zeros(3),
                      slice(0, width))


def test_the_window_and_bound_are_checked_when_the_shift_is_built() -> None:
    ActivationShift(_line_head(), np.zeros(2), 1.0, window=1.0)  # one sample: allowed
    with pytest.raises(ValueError, match="shift_window must be >= 1"):
        ActivationShift(_line_head(), np.zeros(2), 1.0, window=0.5)
    with pytest.raises(ValueError, match="shift_max must be > 0"):
        ActivationShift(_line_head(), np.zeros(2), 1.0, window=8.0, max_distance=0.0)


def test_the_source_mean_falls_back_to_the_feature_statistics_only_without_a_norm() -> None:
    from types import SimpleNamespace

    from eva0_edge.runtime.head import HeadError
    from eva0_edge.runtime.shift import source_head_mean

    plain = LinearHead(np.ones((3, 2)), np.zeros(3), slice(1, 3))
    normed = LinearHead(np.ones((3, 2)), np.zeros(3), slice(1, 3),
                        (np.ones(2), np.zeros(2), 1e-6))
    stats = SimpleNamespace(arrays={"source_mean": np.array([5.0, 6.0, 7.0])},
                            has_source_stats=True)
    np.testing.assert_array_equal(source_head_mean(stats, plain), [6.0, 7.0])
    with pytest.raises(HeadError, match="eva0-edge calibrate"):
        source_head_mean(stats, normed)  # the source mean is not the normalised input's
    with pytest.raises(HeadError, match="eva0-edge calibrate"):
        source_head_mean(SimpleNamespace(arrays={}, has_source_stats=False), plain)
    calibrated = SimpleNamespace(arrays={**stats.arrays, "head_input_mean": np.array([1, 2])},
                                 has_source_stats=True)
    np.testing.assert_array_equal(source_head_mean(calibrated, normed), [1.0, 2.0])


def test_the_bound_waits_for_64_samples_and_restarts_at_once_when_they_are_far() -> None:
    near = ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0, max_distance=100.0)
    state = _empty_state()
    rng = np.random.default_rng(9)
    near.observe(state, rng.normal(0.5, 1.0, (60, 9)))
    assert not near.offset(state).any()  # 60 < 64 samples
    near.observe(state, rng.normal(0.5, 1.0, (10, 9)))
    assert near.offset(state).any()
    far = ActivationShift(_line_head(), np.full(2, 3.0), 1.0, window=256.0, max_distance=1.0)
    state = _empty_state()
    far.observe(state, rng.normal(3.2, 0.5, (64, 9)))  # near a source mean of 3
    assert far.restarts == 0
    far.observe(state, rng.normal(-3.0, 0.5, (64, 9)))  # a change: the long window refills
    assert (far.changes, far.restarts) == (1, 0)
    far.observe(state, rng.normal(-3.0, 0.5, (64, 9)))  # 64 samples far from it: a restart
    far.observe(state, rng.normal(-3.0, 0.5, (64, 9)))  # and again
    assert (far.changes, far.restarts) == (1, 2) and state.shift_weight == 0.0


def test_a_mean_exactly_at_the_bound_is_kept() -> None:
    rows = np.tile([3.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], (64, 1))
    probe = _empty_state()
    ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0).observe(probe, rows)
    bound = float(np.linalg.norm(probe.shift_mean))
    shift = ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0, max_distance=bound)
    state = _empty_state()
    shift.observe(state, rows)
    assert shift.restarts == 0 and state.shift_weight > 0


def test_a_short_window_keeps_its_mean_once_its_weight_rounds_to_one() -> None:
    """Window 2 (a = 1/3): after 100 samples 1 - a^n is 1.0 in float64."""
    shift = ActivationShift(_line_head(), np.zeros(2), 1.0, window=2.0)
    state = _empty_state()
    rows = np.random.default_rng(10).normal(1.0, 1.0, (100, 9))
    for row in rows:
        shift.observe(state, row[None])
    a, raw = 1 / 3, np.zeros(2)
    for row in rows:
        raw = a * raw + (1 - a) * row[:2]
    assert state.shift_weight == 1.0 and state.shift_recent_weight == 1.0
    np.testing.assert_allclose(state.shift_mean, raw, rtol=1e-9)
    np.testing.assert_allclose(state.shift_recent, raw, rtol=1e-9)


@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_a_change_is_flagged_when_the_recent_mean_is_three_standard_errors_out(scale) -> None:
    """z^2 = ||m_recent - m_long||^2 x 32 / var (the long window's total variance) over 9:
    checked at every sample of a stream that moves by one standard deviation, at any scale of
    the features."""
    rng = np.random.default_rng(11)
    shift = ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0)
    state = _empty_state()
    for _ in range(300):
        shift.observe(state, scale * rng.normal(0.0, 1.0, (1, 9)))
    below = []
    for _ in range(100):
        before = shift.changes
        shift.observe(state, np.full((1, 9), scale))
        variance = state.shift_sq - state.shift_mean @ state.shift_mean
        z2 = float(((state.shift_recent - state.shift_mean) ** 2).sum()) * 32 / variance
        assert (shift.changes > before) == (z2 > 9), z2
        if shift.changes > before:
            break
        below.append(z2)
    assert shift.changes == 1 and max(below) > 6  # some steps between z = 2.45 and 3


def test_a_restored_state_without_a_recent_window_sees_no_change_in_its_first_samples() -> None:
    """A state saved before the recent window existed: the change test waits for the recent
    window to fill instead of reading one sample's noise as a change."""
    rng = np.random.default_rng(12)
    shift = ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0)
    state = _empty_state()
    shift.observe(state, rng.normal(0.0, 1.0, (300, 9)))
    state.shift_recent, state.shift_recent_sq, state.shift_recent_weight = np.zeros(0), 0.0, 0.0
    shift.observe(state, np.full((1, 9), 1.5))  # 1.5 sd out: z about 8 were it a full window
    for _ in range(8):
        shift.observe(state, rng.normal(0.0, 1.0, (1, 9)))
    assert shift.changes == 0


def test_spread_thresholds_are_strict_and_the_full_recent_window_counts() -> None:
    """Variance exactly MIN_SPREAD (5%) of the mean square: shifted, not degenerate; a
    recent window at exactly RECENT_SAMPLES samples' weight is full."""
    shift = ActivationShift(_line_head(3), np.zeros(3), 1.0, window=256.0)
    state = AdaptState.initial(np.zeros(1, dtype=np.float32), 3, 3, 0)
    state.shift_mean, state.shift_sq, state.shift_weight = np.array([3.0, 1.0, 3.0]), 20.0, 1.0
    assert shift.offset(state).any()  # variance 1 = 5% of 20
    state.shift_recent, state.shift_recent_sq = np.array([3.0, 1.0, 3.0]), 20.0
    state.shift_recent_weight = 1.0 - shift.recent_factor**32
    assert not shift.degenerate(state)
    state.shift_recent_sq = 19.5  # variance 0.5 < 5% of 19.5
    assert shift.degenerate(state)


def test_the_configured_bound_reaches_the_shift_and_a_cold_cache_reads_the_head(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EVA0_CACHE", str(tmp_path))
    resnet = SHIPPED[1]
    cold = Policy.load(resnet, "eva0", {"activation_shift": 1.0, "shift_max": 0.75},
                              provider="cpu")
    warm = Policy.load(resnet, "eva0", {"activation_shift": 1.0}, provider="cpu")
    assert cold.shift.max_distance == 0.75
    np.testing.assert_array_equal(cold.shift.head.weight, warm.shift.head.weight)
    assert any((tmp_path / "head").iterdir())


def test_an_empty_window_with_a_stray_weight_serves_unshifted_and_restarts() -> None:
    """A state whose shift means are empty but whose weights are not (hand-made: nothing the
    runtime writes): nothing is shifted, and the first batch starts the windows afresh."""
    shift = ActivationShift(_line_head(), np.zeros(2), 1.0, window=256.0)
    state = _empty_state()
    state.shift_weight = state.shift_recent_weight = 1.0
    assert not shift.offset(state).any()
    rows = np.random.default_rng(13).normal(0.0, 1.0, (4, 9))
    shift.observe(state, rows)
    for window, mean in ((256, state.shift_mean), (32, state.shift_recent)):
        a = 1 - 2 / (window + 1)
        weights = a ** np.arange(3, -1, -1)
        np.testing.assert_allclose(mean, weights @ rows[:, :2] / weights.sum())


def test_the_kept_offset_is_the_offset_of_the_window_as_it_is_now() -> None:
    rng = np.random.default_rng(11)
    head = LinearHead(rng.normal(size=(3, 4)), np.zeros(3), slice(0, 4))
    shift = ActivationShift(head, np.zeros(4), strength=1.0, window=64.0)
    state = _empty_state()

    def fresh() -> np.ndarray:  # a shift that has kept nothing
        return ActivationShift(head, np.zeros(4), strength=1.0, window=64.0).offset(state)

    seen = []
    for row in rng.normal(2.0, 1.0, (80, 9)):
        shift.observe(state, row[None])
        served = shift.offset(state)
        np.testing.assert_array_equal(served, fresh())
        np.testing.assert_array_equal(shift.offset(state), served)  # asked again: the same
        seen.append(served.copy())
    assert len({s.tobytes() for s in seen[40:]}) == 40  # every sample moved it
    with pytest.raises(ValueError, match="read-only"):
        served[0] = 0.0
    state.shift_mean[0] += 1.0  # written in place: same weight, same array object
    np.testing.assert_array_equal(shift.offset(state), fresh())
    assert not np.array_equal(shift.offset(state), served)
    other = _empty_state()  # another state (installed, reset) with the same window values
    other.shift_mean, other.shift_sq, other.shift_weight = (
        state.shift_mean.copy(), state.shift_sq, state.shift_weight)
    np.testing.assert_array_equal(shift.offset(other), fresh())
    shift.restart(state)
    np.testing.assert_array_equal(shift.offset(state), np.zeros(3))
