"""The health guard on the shipped ResNet-GN: every signal trips on a forced collapse, the
rollback restores exactly the saved healthy theta, clean streams do not trip it, and the frozen
mode predicts without adapting."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.bench.testbed.evaluate import EvalSpec, load_domains
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.guard import GuardBounds, HealthGuard
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from eva0_edge.runtime.session import SessionSettings
from tests.fixtures import SHIPPED

RESNET = SHIPPED[1]
NO_BOUNDS = {f"guard_{name}": None for name in GuardBounds.__dataclass_fields__}


def _clean_images(model) -> tuple[np.ndarray, np.ndarray]:
    """2048 seeded clean test images [N, C, H, W], preprocessed for ``model``, and labels [N]."""
    images, labels = load_fashion_mnist("test")
    order = np.random.default_rng(11).permutation(len(labels))[:2048]
    return preprocess_uint8(images[order], read_metadata(model).preprocessing), labels[order]


@pytest.fixture(scope="module")
def clean() -> tuple[np.ndarray, np.ndarray]:
    return _clean_images(RESNET)


def _watching(bounds: dict, eta_scale: float = 1.0) -> Policy:
    """The ResNet-GN with only ``bounds`` set and no audit at a change of stream (the shift's
    detector fires on a collapsing model's features: these tests watch the bounds alone)."""
    eta = Policy.load(RESNET, "eva0", provider="cpu").config.eta
    config = {"guard": True, **NO_BOUNDS, **bounds, "eta": eta * eta_scale,
              "guard_change_audit": False}
    return Policy.load(RESNET, "eva0", config, provider="cpu", threads=1)


def _healthy_range(x: np.ndarray) -> dict[str, tuple[float, float]]:
    model = _watching({})
    seen: dict[str, list[float]] = {}
    for i in range(0, 768, 16):
        model.step(x[i : i + 16])
        if model.guard.windows.samples >= model.guard.warmup:
            for name, value in model.stats()["guard"]["signals"].items():
                seen.setdefault(name, []).append(value)
    return {name: (min(v), max(v)) for name, v in seen.items()}


@pytest.mark.parametrize(
    "signal,bound",
    [("entropy", "max"), ("logit_norm", "min"), ("drift", "max"), ("alignment", "max")],
)
def test_each_signal_trips_on_a_forced_collapse(clean, signal, bound):
    """eta x 1000 turns the model to noise (accuracy ~10%): near-uniform predictions, smaller
    logits, theta and the feature moments far from the source. A bound set 1.5x past the range
    of a healthy run trips, and names its signal."""
    x, _ = clean
    low, high = _healthy_range(x)[signal]
    value = low / 1.5 if bound == "min" else high * 1.5
    if signal == "entropy":
        value = 1 - (1 - high) / 1.5
    model = _watching({f"guard_{signal}_{bound}": value}, eta_scale=1000)
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
    stats = model.stats()
    assert stats["guard"]["trips"] >= 1
    assert stats["guard"]["last_reason"].startswith(signal)


def test_spread_trips_on_a_one_class_stream(clean):
    x, _ = clean
    low, _ = _healthy_range(x)["spread"]
    model = _watching({"guard_spread_min": low / 1.5})
    black = np.repeat(x[:1] * 0 + x.min(), 16, axis=0)
    for _ in range(32):
        model.step(black)
    assert model.stats()["guard"]["trips"] >= 1
    assert model.stats()["guard"]["last_reason"].startswith("spread")


def test_rollback_restores_exactly_the_saved_healthy_theta(clean):
    x, _ = clean
    model = _watching({"guard_drift_max": 5.0})
    for i in range(0, 640, 16):
        model.step(x[i : i + 16])
    saved = model.state.healthy_theta.copy()
    assert not np.array_equal(saved, read_metadata(RESNET).theta0)  # a checkpoint was taken
    model.model.config = model.config.updated({"eta": model.config.eta * 1000})
    model.step(x[640:656])
    assert model.state.guard_trips == 1
    np.testing.assert_array_equal(model.state.theta, saved)
    assert model.stats()["paused_samples_left"] == model.config.guard_pause
    theta = model.state.theta.copy()
    model.step(x[656:672])  # paused: predicts, does not adapt
    np.testing.assert_array_equal(model.state.theta, theta)


def test_a_second_trip_right_after_a_rollback_goes_to_theta0(clean):
    x, _ = clean
    model = _watching({"guard_drift_max": 5.0}, eta_scale=1000)
    model.model.config = model.config.updated({"guard_pause": 16})
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
        if model.state.guard_trips >= 2:
            break
    assert model.state.guard_trips >= 2
    np.testing.assert_array_equal(model.state.healthy_theta, read_metadata(RESNET).theta0)


@pytest.mark.parametrize("batch", [1, 64])
def test_no_trip_on_clean_images_with_the_shipped_bounds(clean, batch):
    x, _ = clean
    model = Policy.load(RESNET, "eva0", provider="cpu", threads=1)
    assert model.config.guard and model.config.guard_drift_max is not None
    for i in range(0, 2048, batch):
        model.step(x[i : i + batch])
    assert model.stats()["guard"]["trips"] == 0


def test_frozen_predicts_without_adapting_and_persists(clean, tmp_path):
    x, _ = clean
    model = Policy.load(RESNET, "eva0", provider="cpu", threads=1)
    model.step(x[:16])
    model.freeze()
    theta = model.state.theta.copy()
    forwards = model.stats()["forwards"]
    model.step(x[16:32])
    np.testing.assert_array_equal(model.state.theta, theta)
    assert model.stats()["forwards"] - forwards == 16 and model.stats()["frozen"]
    model.save_state(tmp_path / "s.npz")
    other = Policy.load(RESNET, "eva0", provider="cpu")
    other.load_state(tmp_path / "s.npz")
    assert other.stats()["frozen"]
    other.freeze(False)
    other.step(x[32:48])
    assert not np.array_equal(other.state.theta, theta)


def _trip_on_drift(model: Policy, x: np.ndarray) -> None:
    """One step at eta x 1000: theta jumps past the drift bound and the guard trips."""
    eta = model.config.eta
    model.model.config = model.config.updated({"eta": eta * 1000})
    trips = model.state.guard_trips
    model.step(x)
    model.model.config = model.config.updated({"eta": eta})
    assert model.state.guard_trips == trips + 1


def test_the_pause_duels_the_checkpoint_against_theta0_and_keeps_a_healthy_one(clean):
    """During the pause each batch runs at the checkpoint and at theta0 (two forwards per
    sample), theta0's logits are served; on clean images the checkpoint is healthy and
    adaptation resumes from it."""
    x, _ = clean
    model = Policy.load(RESNET, "eva0", {"guard_drift_max": 5.0, "activation_shift": 0.0},
                               threads=1)  # theta0's own logits are served (no shift on them)
    source = Policy.load(RESNET, "noadapt", threads=1)
    for i in range(0, 640, 16):
        model.step(x[i : i + 16])
    _trip_on_drift(model, x[640:656])
    saved = model.state.healthy_theta.copy()
    forwards = model.stats()["forwards"]
    for i in range(656, 656 + model.config.guard_pause, 16):
        np.testing.assert_allclose(model.step(x[i : i + 16]), source.predict(x[i : i + 16]),
                                   atol=1e-5)
    assert model.stats()["forwards"] - forwards == 2 * model.config.guard_pause
    assert model.stats()["guard"]["pause_verdicts"] == {"checkpoint": 1, "theta0": 0, "hold": 0}
    np.testing.assert_array_equal(model.state.theta, saved)
    model.step(x[1000:1016])
    assert not np.array_equal(model.state.theta, saved)  # adapting again


def test_a_broken_checkpoint_loses_the_duel_to_theta0(clean):
    x, _ = clean
    model = Policy.load(RESNET, "eva0", {"guard_drift_max": 5.0}, threads=1)
    for i in range(0, 320, 16):
        model.step(x[i : i + 16])
    theta0 = read_metadata(RESNET).theta0
    noise = np.random.default_rng(0).normal(0, 3.0, theta0.shape).astype(np.float32)
    model.state.healthy_theta = theta0 + noise  # a checkpoint that turned the model to noise
    _trip_on_drift(model, x[320:336])
    for i in range(336, 336 + model.config.guard_pause, 16):
        model.step(x[i : i + 16])
    assert model.stats()["guard"]["pause_verdicts"]["theta0"] == 1
    np.testing.assert_array_equal(model.state.theta, theta0)


def test_a_stream_that_breaks_the_source_too_holds_at_theta0_until_it_ends(clean):
    """Black frames: the guard pauses (a trip, or an audit when a change of stream is seen),
    theta0's own spread is out of bounds, so it serves theta0 without adapting (one forward
    per sample) for as long as they last, then adapts again."""
    x, _ = clean
    model = Policy.load(RESNET, "eva0", threads=1)
    black = np.repeat(x[:1] * 0 + x.min(), 16, axis=0)
    for _ in range(64):
        model.step(black)
    guard = model.stats()["guard"]
    assert guard["trips"] + guard["audits"] >= 1 and guard["pause_verdicts"]["hold"] >= 2
    np.testing.assert_array_equal(model.state.theta, read_metadata(RESNET).theta0)
    forwards = model.stats()["forwards"]
    model.step(black)
    assert model.stats()["forwards"] - forwards == 16
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
    assert model.stats()["guard"]["pause_verdicts"]["theta0"] == 1
    assert model.stats()["guard"]["trips"] == guard["trips"] and model.stats()["drift"] > 0


def test_a_stream_that_breaks_the_source_too_keeps_what_was_learnt_before_it(clean):
    """Black frames after clean adaptation: theta0 fails on them too, so the stream, not the
    adaptation, is to blame. The guard (an audit at the change, or a trip) serves theta0 while
    they last but keeps a healthy theta learnt before them, and adaptation goes on from it
    when clean images return."""
    x, _ = clean
    unshifted = {"activation_shift": 0.0}  # served logits are exactly theta0's during holds
    model = Policy.load(RESNET, "eva0", unshifted, threads=1)
    source = Policy.load(RESNET, "noadapt", threads=1)
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
    assert model.state.guard_trips == 0
    black = np.repeat(x[:1] * 0 + x.min(), 16, axis=0)
    served_source = 0
    for _ in range(64):
        paused = model.state.pause_left > 0
        served = model.step(black)
        if paused:
            np.testing.assert_allclose(served, source.predict(black), atol=1e-5)
            served_source += 1
    verdicts = model.stats()["guard"]["pause_verdicts"]
    assert served_source >= 60 and verdicts["hold"] >= 2 and verdicts["theta0"] == 0
    kept = model.state.theta.copy()
    assert not np.array_equal(kept, read_metadata(RESNET).theta0)
    for i in range(1024, 2048, 16):
        model.step(x[i : i + 16])
    verdicts = model.stats()["guard"]["pause_verdicts"]
    assert verdicts["checkpoint"] >= 1 and verdicts["theta0"] == 0
    assert not np.array_equal(model.state.theta, kept)


def test_an_audit_serves_the_current_theta_and_keeps_it_on_the_stream_it_learnt(clean):
    x, _ = clean
    unshifted = {"activation_shift": 0.0}  # the served logits are the duelled theta's own
    model = Policy.load(RESNET, "eva0", {"guard_audit": 512, **unshifted}, threads=1)
    for i in range(0, 512, 16):
        model.step(x[i : i + 16])
    assert model.stats()["guard"]["audits"] == 1 and model.stats()["paused_samples_left"] > 0
    theta = model.state.theta.copy()
    current = Policy.load(RESNET, "eva0", unshifted, threads=1)
    current.state.theta = theta.copy()
    forwards = model.stats()["forwards"]
    for i in range(512, 512 + model.config.guard_warmup, 16):
        np.testing.assert_allclose(model.step(x[i : i + 16]), current.predict(x[i : i + 16]),
                                   atol=1e-5)
    assert model.stats()["forwards"] - forwards == 2 * model.config.guard_warmup
    assert model.stats()["guard"]["pause_verdicts"]["checkpoint"] == 1
    np.testing.assert_array_equal(model.state.theta, theta)


def test_an_audit_hands_a_theta_far_from_the_source_back_to_theta0(clean):
    """A theta that moved the features of this stream far from the source statistics (more
    than ``guard_audit_margin`` x theta0's distance) loses the audit even with no bound set."""
    x, _ = clean
    model = _watching({"guard_audit": 64})
    theta0 = read_metadata(RESNET).theta0
    model.state.theta = theta0 + np.random.default_rng(1).normal(0, 0.5, theta0.shape).astype(
        np.float32)
    for i in range(0, 256, 16):
        model.step(x[i : i + 16])
    assert model.stats()["guard"]["pause_verdicts"]["theta0"] >= 1
    assert model.stats()["guard"]["trips"] == 0


def test_the_activation_shift_forgets_a_stream_the_guard_held_on(clean):
    """Unbounded shift (no shift_max): its window learns the black frames while the guard
    holds, and restarts when the hold ends, so the clean images after are not moved by them."""
    x, _ = clean
    model = Policy.load(RESNET, "eva0", {"activation_shift": 1.0, "shift_max": None},
                               threads=1)
    black = np.repeat(x[:1] * 0 + x.min(), 16, axis=0)
    for _ in range(64):
        model.step(black)
    assert model.stats()["guard"]["pause_verdicts"]["hold"] >= 2
    assert model.state.shift_weight > 0.9
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
        if model.stats()["guard"]["pause_verdicts"]["theta0"]:
            break
    assert model.stats()["guard"]["pause_verdicts"]["theta0"] == 1
    assert model.state.shift_weight == 0.0


def test_a_return_to_clean_images_after_noise_frames_is_judged_on_the_clean_images():
    """Frost, then uniform-noise frames, then clean images (512 each, batch 16, shipped ViT):
    the noise holds the frost-adapted theta (theta0 fails on noise too) while theta0 is served;
    the duel that decides what follows starts again when the stream changes, so it is made on
    clean images alone, where theta0 wins. Clean accuracy equals NoAdapt's (before: the duel
    straddled noise and clean, and the first 128 clean images lost 36 points)."""
    vit = SHIPPED[0]
    spec = EvalSpec(model=str(vit), dataset="fmnist-c", protocol="continual", severity=5,
                    batch_size=16, methods=["eva0"], corruptions=["frost", "noise", "clean"],
                    limit=512, session=SessionSettings(threads=1))
    domains = load_domains(spec, progress=False)
    pre = read_metadata(vit).preprocessing
    clean_hits = {}
    for name in ("noadapt", "eva0"):
        model = Policy.load(vit, name, threads=1)
        for domain in domains:
            hits = [int((model.step(x).argmax(1) == y).sum()) for x, y in domain.batches(16, pre)]
        clean_hits[name] = sum(hits)
    verdicts = model.stats()["guard"]["pause_verdicts"]
    assert verdicts["hold"] >= 1 and verdicts["theta0"] >= 1
    assert clean_hits["eva0"] >= clean_hits["noadapt"] - 5  # 1% of 512


def test_an_audit_on_black_frames_keeps_the_checkpoint_learnt_before_them():
    """The shipped ViT adapts on clean images, then black frames start: the new stream starts
    an audit at once, theta0 fails on black frames too, so theta0 is served while they last and
    the last healthy checkpoint, from before them, is what adaptation goes on from when clean
    images return (not the theta the audit duelled, which adapted on black frames)."""
    vit = SHIPPED[0]
    x, y = _clean_images(vit)
    model = Policy.load(vit, "eva0", threads=1)
    source = Policy.load(vit, "noadapt", threads=1)
    for i in range(0, 1024, 16):
        model.step(x[i : i + 16])
    checkpoint = model.state.healthy_theta.copy()
    assert not np.array_equal(checkpoint, model.metadata.theta0)
    black = np.repeat(x[:1] * 0 + x.min(), 16, axis=0)
    for _ in range(64):
        model.step(black)
    guard = model.stats()["guard"]
    assert guard["audits"] >= 1 and guard["pause_verdicts"]["hold"] >= 2
    np.testing.assert_array_equal(model.state.theta, checkpoint)
    adapted = sum(int((model.step(x[i : i + 16]).argmax(1) == y[i : i + 16]).sum())
                  for i in range(1024, 2048, 16))
    reference = sum(int((source.predict(x[i : i + 16]).argmax(1) == y[i : i + 16]).sum())
                    for i in range(1024, 2048, 16))
    assert model.stats()["guard"]["pause_verdicts"]["checkpoint"] >= 1
    assert adapted >= reference - 10  # 1% of 1024


def _duel(candidate: np.ndarray, source: np.ndarray) -> HealthGuard:
    """A guard (spread bound only) that saw one 64-sample duel: logits [64, K] per side."""
    bounds = GuardBounds(**{**dict.fromkeys(GuardBounds.__dataclass_fields__), "spread_min": 0.5})
    guard = HealthGuard(bounds, window=256, warmup=64, checkpoint_every=256)
    features = np.zeros((128, 4))
    guard.observe_pause(np.concatenate([candidate, source]), features, dueled=True)
    return guard


def test_a_duel_on_a_stream_the_source_fails_holds_at_theta0_even_for_a_healthy_candidate():
    """The source collapsed to one class (its spread out of bounds) puts the blame on the
    stream: its signals cannot vouch for any theta there, so the guard serves theta0 and keeps
    the candidate for the next duel, even when the candidate's own signals are in bounds (on
    the shipped ViT the candidate served brightness at 30% where theta0 with the activation
    shift served 42%). With the source in bounds, a healthy candidate wins."""
    rng = np.random.default_rng(0)
    spread = rng.normal(size=(64, 10)) * 3
    collapsed = np.tile(np.eye(10)[0] * 5, (64, 1))
    guard = _duel(spread, collapsed)
    assert guard.pause_verdict(dueled=True, needed=64) == "hold" and guard.hold_candidate
    guard = _duel(spread, spread[::-1])
    assert guard.pause_verdict(dueled=True, needed=64) == "checkpoint"
    guard = _duel(collapsed, spread)
    assert guard.pause_verdict(dueled=True, needed=64) == "theta0"


def test_a_return_to_clean_after_noise_is_audited_at_once_serving_theta0():
    """The shipped ViT adapts on 384 images with Gaussian noise of sigma 0.3 (a cheap sensor in
    low light), then clean images return. Its features show no change of stream (the
    activation shift's detector is silent); the images do: an audit starts within the first
    64 clean images, serves theta0 (unshifted here: exactly NoAdapt's logits), and hands the
    noise-adapted theta back to theta0. The clean part is served within 1 point of NoAdapt
    (before: 2.2 points under it, 0 audits)."""
    vit = SHIPPED[0]
    pre = read_metadata(vit).preprocessing
    noisy = preprocess_uint8(corrupted_fmnist("test", "gauss-0.3", 1, 0,
                                              indices=np.arange(384))[0], pre)
    images, labels = corrupted_fmnist("test", "clean", 1, 0, indices=np.arange(384, 1152))
    x = preprocess_uint8(images, pre)
    unshifted = {"activation_shift": 0.0}
    model = Policy.load(vit, "eva0", unshifted, threads=1)
    source = Policy.load(vit, "noadapt", unshifted, threads=1)
    for i in range(0, len(noisy), 16):
        model.step(noisy[i:i + 16])
    assert model.stats()["guard"]["audits"] == 0 and model.state.guard_trips == 0
    hits, reference, audited = 0, 0, 0
    for i in range(0, len(x), 16):
        batch, truth = x[i:i + 16], labels[i:i + 16]
        in_audit = model.guard.auditing
        served, plain = model.step(batch), source.predict(batch)
        if in_audit:
            audited += 16
            np.testing.assert_allclose(served, plain, atol=1e-5)
        hits += int((served.argmax(1) == truth).sum())
        reference += int((plain.argmax(1) == truth).sum())
    guard = model.stats()["guard"]
    assert guard["audits"] == 1 and guard["pause_verdicts"]["theta0"] == 1
    assert model.inputs.changes == 1 and audited >= model.config.guard_warmup - 16
    assert hits >= reference - len(x) // 100
