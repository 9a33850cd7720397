"""The compute budget: the forward counter stays within it, a budget of one forward is the
shift alone, a full budget is the method as it is, the bucket's fill survives a state file."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.budget import BURST_SAMPLES, forwards_bound
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.component.test_budget import RESNET


@pytest.fixture(scope="module")
def fmnist_clean() -> np.ndarray:
    images, _ = load_fashion_mnist("test")
    order = np.random.default_rng(5).permutation(len(images))[:2048]
    return preprocess_uint8(images[order], read_metadata(RESNET).preprocessing)


@pytest.mark.parametrize("burst", [BURST_SAMPLES, 128])
def test_the_forward_counter_stays_within_the_budget(fmnist_clean, burst):
    model = Policy.load(RESNET, "eva0", {"budget": 1.25, "budget_burst": burst},
                               threads=1)
    for i in range(0, len(fmnist_clean), 16):
        model.step(fmnist_clean[i:i + 16])
    stats = model.stats()
    assert 1.1 < stats["forwards_per_sample"] <= forwards_bound(1.25, burst, len(fmnist_clean), 16)
    assert stats["budget"]["burst"] == burst
    counted = stats["budget"]["adapted_samples"] + stats["budget"]["served_samples"]
    assert counted == len(fmnist_clean)
    assert stats["drift"] > 0


def test_the_guards_duels_stay_within_the_budget(fmnist_clean):
    """Clean images, black frames (theta0 fails on them too: the guard holds, dueling the
    theta learnt before them against theta0 while the credit pays for it), clean again: the
    forward counter stays within the budget, its bucket, and one audit's overrun; the held
    theta gives way to theta0 once the credit cannot pay for the next duel."""
    model = Policy.load(RESNET, "eva0", {"budget": 1.25}, threads=1)
    black = np.repeat(fmnist_clean[:1] * 0 + fmnist_clean.min(), 16, axis=0)
    stream = [fmnist_clean[i:i + 16] for i in range(0, 1024, 16)] + [black] * 64 + \
        [fmnist_clean[i:i + 16] for i in range(1024, 2048, 16)]
    for x in stream:
        model.step(x)
    stats, samples = model.stats(), 16 * len(stream)
    assert stats["guard"]["pause_verdicts"]["hold"] >= 2
    allowance = (0.25 * BURST_SAMPLES + model.config.guard_warmup + 16) / samples
    assert stats["forwards_per_sample"] <= 1.25 + allowance


def test_samples_in_the_guards_duels_earn_their_credit_too(fmnist_clean):
    """Every sample adds F - 1 to the credit, one the guard's duel serves too: over a duel of
    the adapted theta against theta0 (two forwards a sample) the credit moves by exactly
    (F - 1) n minus the forwards run beyond one a sample (it fell by all of them when only
    samples outside a duel earned, and the budget went unspent)."""
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    for i in range(0, 256, 16):
        model.step(fmnist_clean[i:i + 16])
    model.budget.credit = 100.0  # room below the cap, so nothing earned is cut off
    model.state.pause_left = 64  # the guard's pause: theta0 against the adapted theta
    before, credit = model.stats(), model.budget.credit
    for i in range(256, 320, 16):
        model.step(fmnist_clean[i:i + 16])
    after = model.stats()
    samples = after["samples"] - before["samples"]
    extra = after["forwards"] - before["forwards"] - samples
    assert samples == 64 and extra == 64  # dueled: two forwards a sample
    assert model.budget.credit == pytest.approx(credit + 0.5 * samples - extra)


@pytest.mark.integration  # a Fashion-MNIST stream
def test_a_duel_is_lengthened_only_while_the_credit_pays_for_it():
    """Clean and noisy images in turns of 48 samples, a change of stream inside every duel:
    each change lengthens the running duel only while the credit pays for it, else theta0
    wins it; so the credit never goes below one batch's debt and the forward counter stays
    within the budget and its bucket (it lengthened the first duel to the end of the stream,
    two forwards a sample at budget 1.5, 520 forwards in debt)."""
    pre = read_metadata(RESNET).preprocessing
    n, batch = 2048, 16
    clean, noisy = (preprocess_uint8(corrupted_fmnist("test", kind, 1, 0, indices=np.arange(n),
                                                      progress=False)[0], pre)
                    for kind in ("clean", "gauss-0.3"))
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    lowest = 0.0
    for i in range(0, n, batch):
        model.step((noisy if (i // 48) % 2 else clean)[i:i + batch])
        lowest = min(lowest, model.budget.credit)
    assert model.stats()["guard"]["audits"] >= 1
    assert lowest >= -batch
    assert model.stats()["forwards_per_sample"] <= forwards_bound(1.5, BURST_SAMPLES, n, batch)


@pytest.mark.parametrize("batch", [1, 16])
def test_one_forward_tier_is_one_computation_by_both_names(fmnist_clean, batch):
    """eva0 at budget 1 and noadapt-shift: bit for bit the same logits, on a stream that
    changes (Gaussian noise of std 0.3, then clean), stepped and served as the asynchronous
    server serves; one forward per sample, theta0 throughout,
    nothing adapting."""
    noisy, _ = corrupted_fmnist("test", "gauss-0.3", 5, 2026, np.arange(256))
    stream = np.concatenate([
        preprocess_uint8(noisy, read_metadata(RESNET).preprocessing), fmnist_clean[:256]])
    budget_one = Policy.load(RESNET, "eva0", {"budget": 1.0}, threads=1)
    tier = Policy.load(RESNET, "noadapt-shift", threads=1)
    served_one = Policy.load(RESNET, "eva0", {"budget": 1.0}, threads=1)
    served_one.set_asynchronous()
    for i in range(0, len(stream), batch):
        x = stream[i:i + batch]
        logits = tier.step(x)
        np.testing.assert_array_equal(budget_one.step(x), logits)
        np.testing.assert_array_equal(served_one.serve_step(x), logits)
        assert served_one.begin_pass(x) is None
    for model in (budget_one, tier, served_one):
        assert model.stats()["forwards_per_sample"] == 1.0
        assert not model.health().adapting
        np.testing.assert_array_equal(model.state.theta, read_metadata(RESNET).theta0)
    assert budget_one.config.activation_shift == tier.config.activation_shift > 1.0


def test_a_full_budget_is_the_method_as_it_is(fmnist_clean):
    full = Policy.load(RESNET, "eva0", {"budget": 2.0}, threads=1)
    plain = Policy.load(RESNET, "eva0", threads=1)
    for i in range(0, 512, 16):
        x = fmnist_clean[i:i + 16]
        np.testing.assert_array_equal(full.step(x), plain.step(x))
    np.testing.assert_array_equal(full.state.theta, plain.state.theta)


def test_the_bucket_fill_is_saved_with_the_state(fmnist_clean, tmp_path):
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    for i in range(0, 768, 16):
        model.step(fmnist_clean[i:i + 16])
    fill = model.budget.fill
    assert 0 <= fill < 1
    path = model.save_state(tmp_path / "s.npz")
    again = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    again.load_state(path)
    assert again.budget.fill == pytest.approx(fill)
    state = again.state_dict()
    with pytest.raises(ValueError, match="budget_fill"):
        again.load_state_dict({**state, "budget_fill": 1.5})
    assert again.budget.fill == pytest.approx(fill)
