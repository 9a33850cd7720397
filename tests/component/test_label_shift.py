"""The activation shift's label-shift correction: a run of one class is not moved off that class,
an i.i.d. stream is shifted as without the correction, the class mixes live in the state (saved,
validated, restored from the domain bank exactly), and calibration writes the per-class means."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.calibrate import source_statistics
from eva0_edge.runtime.data import InputStream
from eva0_edge.runtime.head import LinearHead, cached_head
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import AdaptableSession
from eva0_edge.runtime.shift import ActivationShift
from eva0_edge.runtime.state import AdaptState, StateError, decode_state, encode_state
from tests.fixtures import SHIPPED, uniform_batch

CLASSES, WIDTH = 10, 12
MEANS = 2.0 * np.eye(CLASSES, WIDTH)  # class c's source head input: 2 e_c
OFFSET = np.linspace(-0.5, 0.5, WIDTH)  # what the "corruption" adds to every head input


def _shift(corrected: bool) -> ActivationShift:
    head = LinearHead(MEANS.copy(), np.zeros(CLASSES), slice(0, WIDTH))
    return ActivationShift(head, MEANS.mean(axis=0), strength=1.0, window=256.0,
                           class_means=MEANS if corrected else None,
                           prior_window=1024.0 if corrected else None)


def _state() -> AdaptState:
    return AdaptState.initial(np.zeros(1, dtype=np.float32), CLASSES, WIDTH, 0)


def _samples(labels: np.ndarray, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, 0.3, (labels.size, WIDTH))
    return MEANS[labels] + OFFSET + noise


def _served_accuracy(shift: ActivationShift, labels: np.ndarray, batch: int = 16) -> float:
    state, correct = _state(), 0
    h = _samples(labels, seed=1)
    for i in range(0, labels.size, batch):
        rows = h[i:i + batch]
        logits = rows @ MEANS.T + shift.offset(state)
        correct += int((logits.argmax(axis=1) == labels[i:i + batch]).sum())
        shift.observe(state, rows)
    return correct / labels.size


def test_a_run_of_one_class_keeps_its_class_and_is_shifted_by_the_offset_alone() -> None:
    runs = np.repeat(np.arange(CLASSES), 200)  # class-sorted: runs of 200
    assert _served_accuracy(_shift(corrected=False), runs) < 0.75  # moved off the run's class
    assert _served_accuracy(_shift(corrected=True), runs) > 0.99
    run = _samples(np.zeros(200, dtype=int), seed=2)
    shift, state = _shift(corrected=True), _state()
    plain, plain_state = _shift(corrected=False), _state()
    shift.observe(state, run)
    plain.observe(plain_state, run)
    assert shift.label_persistence(state) > 0.9
    # the gap is mostly the offset, where without the correction it is class 0's own mean
    error = np.linalg.norm(shift.gap(state) + OFFSET)
    assert error < 0.4 * np.linalg.norm(plain.gap(plain_state) + OFFSET)


def test_frames_of_one_repeated_image_do_not_teach_the_stream_mix() -> None:
    """A stuck camera (one image, 500 times) after a balanced stream: pi learns the image's
    class only until the recent window shows no spread (about 40 samples), where counting every
    frame would give that class two thirds of pi; a class run with spread is still learnt."""
    shift, state = _shift(corrected=True), _state()
    balanced = np.tile(np.arange(CLASSES), 103)[:1024]
    h = _samples(balanced, seed=5)
    for i in range(0, h.shape[0], 16):
        shift.observe(state, h[i:i + 16])
    before = state.shift_prior[3]
    stuck = MEANS[3] + OFFSET
    for _ in range(500):
        shift.observe(state, stuck[None])
    assert shift.degenerate(state)
    assert before < 0.12 and state.shift_prior[3] < 0.25
    run = _samples(np.full(500, 3), seed=6)  # the same class, varied images: a label run
    for i in range(0, run.shape[0], 16):
        shift.observe(state, run[i:i + 16])
    assert not shift.degenerate(state) and state.shift_prior[3] > 0.5


def test_an_iid_stream_with_an_uneven_mix_is_shifted_as_without_the_correction() -> None:
    mix = np.full(CLASSES, 0.6 / (CLASSES - 1))
    mix[0] = 0.4
    labels = np.random.default_rng(3).choice(CLASSES, 3000, p=mix)
    h = _samples(labels, seed=4)
    plain, corrected = _shift(corrected=False), _shift(corrected=True)
    plain_state, corrected_state = _state(), _state()
    persistence = []
    for i in range(0, labels.size, 16):
        plain.observe(plain_state, h[i:i + 16])
        corrected.observe(corrected_state, h[i:i + 16])
        persistence.append(corrected.label_persistence(corrected_state))
    assert np.mean(persistence[64:]) < 0.2  # past the prior's first 1024 samples
    correction = np.linalg.norm(corrected.gap(corrected_state) - plain.gap(plain_state))
    assert correction < 0.2 * np.linalg.norm(OFFSET)


def test_the_class_mixes_are_saved_validated_and_older_states_serve_uncorrected() -> None:
    shift, state = _shift(corrected=True), _state()
    shift.observe(state, _samples(np.repeat(np.arange(CLASSES), 40), seed=5))
    back, _ = decode_state(encode_state(state, "f", {}), "f")
    for name in ("shift_classes", "shift_recent_classes", "shift_prior"):
        np.testing.assert_array_equal(getattr(back, name), getattr(state, name))
    forged = state.to_dict()
    forged["shift_prior"] = np.full(CLASSES, 0.5)
    with pytest.raises(StateError, match="shift_prior"):
        AdaptState.from_dict(forged)
    older = state.to_dict()
    for name in ("shift_classes", "shift_recent_classes", "shift_prior"):
        del older[name]
    older_state = AdaptState.from_dict(older)
    np.testing.assert_array_equal(shift.gap(older_state), shift.source_mean - state.shift_mean)


def test_a_bank_recall_restores_the_shift_window_and_its_class_mix_exactly() -> None:
    policy = Policy.load(SHIPPED[1], "eva0", {"bank_slots": 2, "guard": False}, threads=1)
    for seed in range(4):
        policy.step(uniform_batch(16, seed=seed))
    engine = policy.model
    assert engine.shift.corrects_label_shift and engine.state.shift_classes.size == 10
    memory = engine.segment_memory(np.ones(6), 64)
    kept = engine.state.shift_mean.copy(), engine.state.shift_classes.copy()
    for seed in range(4, 8):
        policy.step(uniform_batch(16, seed=seed))
    engine.recall(memory)
    np.testing.assert_array_equal(engine.state.shift_mean, kept[0])
    np.testing.assert_array_equal(engine.state.shift_classes, kept[1])


def test_calibration_writes_each_predicted_class_mean_of_the_head_input() -> None:
    path = SHIPPED[1]
    metadata = read_metadata(path)
    session = AdaptableSession(path, metadata, "cpu")
    images = (np.random.default_rng(6).random((40, 32, 32, 3)) * 255).astype(np.uint8)
    stream = InputStream([str(i) for i in range(len(images))], None, images, None,
                         metadata.preprocessing)
    stats = source_statistics(session, stream, 16, progress=False)
    head = cached_head(path, metadata)
    x = np.concatenate([x for _, x, _ in stream.batches(16)])
    _, features = session.run(x, np.broadcast_to(metadata.theta0, (len(x), metadata.num_params)))
    h = head.head_input(features.astype(np.float64))
    predicted = (h @ head.weight.T + head.bias).argmax(axis=1)
    means = stats["head_input_class_means"].reshape(metadata.num_classes, head.width)
    for c in range(metadata.num_classes):
        expected = h[predicted == c].mean(axis=0) if (predicted == c).any() else h.mean(axis=0)
        np.testing.assert_allclose(means[c], expected, rtol=1e-5, atol=1e-5)
