"""The NumPy objectives and perturbation maths against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.losses import (
    sample_wise_alignment,
    shortcut_resistant_scores,
    softmax_entropy,
)
from eva0_edge.runtime.perturbation import (
    AnchorShare,
    DrawnNormals,
    NormalPrefetch,
    PerturbationPlan,
    anchor_direction,
)


def test_entropy_matches_definition():
    scores = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    p = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(softmax_entropy(scores), -(p * np.log(p)).sum(axis=1))
    assert softmax_entropy(scores)[1] == pytest.approx(np.log(3))


def test_entropy_is_finite_for_logits_far_from_zero_row_by_row():
    """Each row is shifted by its own maximum: rows near +1000 and -1000 side by side."""
    scores = np.array([[1000.0, 999.0], [-1000.0, -1001.0], [1000.0, 1000.0]])
    p = 1 / (1 + np.exp(-1.0))
    expected = -(p * np.log(p) + (1 - p) * np.log(1 - p))
    np.testing.assert_allclose(softmax_entropy(scores), [expected, expected, np.log(2)],
                               rtol=1e-12)


@pytest.mark.parametrize("scale", [0.1, 3.0, 250.0])
def test_shortcut_resistant_scores_are_scale_invariant(scale):
    """s(a o) = s(o) for a > 0, up to the eps in ||o|| + eps."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 10))
    reference = np.linalg.norm(rng.standard_normal((5, 10)), axis=1)
    center = rng.standard_normal(10)
    base = shortcut_resistant_scores(logits, reference, center)
    np.testing.assert_allclose(
        shortcut_resistant_scores(scale * logits, reference, center), base, atol=1e-6
    )
    np.testing.assert_allclose(
        softmax_entropy(shortcut_resistant_scores(scale * logits, reference, center)),
        softmax_entropy(base),
        atol=1e-6,
    )
    # the rescaled logits have the reference norm before decentring
    no_center = shortcut_resistant_scores(logits, reference, None)
    np.testing.assert_allclose(np.linalg.norm(no_center, axis=1), reference, rtol=1e-7)


def test_scores_are_the_rescaled_logits_minus_the_centre():
    """s(o) = (r / ||o||) o - c, row by row, against a hand computation."""
    logits = np.array([[3.0, 4.0, 0.0], [0.0, -2.0, 0.0]])
    reference = np.array([10.0, 1.0])
    center = np.array([1.0, -1.0, 0.5])
    expected = np.array([[6.0, 8.0, 0.0], [0.0, -1.0, 0.0]]) - center
    np.testing.assert_allclose(shortcut_resistant_scores(logits, reference, center, eps=0.0),
                               expected)
    np.testing.assert_allclose(shortcut_resistant_scores(logits, None, center), logits - center)
    with_eps = shortcut_resistant_scores(logits, reference, None, eps=1.0)  # ||o|| + eps
    np.testing.assert_allclose(with_eps, [[5.0, 20.0 / 3.0, 0.0], [0.0, -2.0 / 3.0, 0.0]])


def test_plain_scores_are_not_scale_invariant():
    logits = np.array([[1.0, 0.0, -1.0]])
    assert softmax_entropy(shortcut_resistant_scores(3 * logits, None, None)) < softmax_entropy(
        logits
    )


def test_sample_wise_alignment_matches_hand_computation():
    h = np.array([[1.0, 2.0], [0.0, -1.0]])
    m, q = np.array([0.5, 0.5]), np.array([1.0, 2.0])
    ms, ss = np.array([0.0, 1.0]), np.array([1.0, 0.5])
    rho, eps = 0.9, 1e-8
    expected = []
    for row in h:
        total = 0.0
        for j in range(2):
            m_hat = rho * m[j] + (1 - rho) * row[j]
            q_hat = rho * q[j] + (1 - rho) * row[j] ** 2
            sigma = np.sqrt(max(q_hat - m_hat**2, 0.0) + eps)
            total += (m_hat - ms[j]) ** 2 + (sigma - ss[j]) ** 2
        expected.append(total)
    np.testing.assert_allclose(sample_wise_alignment(h, m, q, ms, ss, rho, eps), expected)
    np.testing.assert_allclose(sample_wise_alignment(h, m, q, ms, ss, rho), expected)  # default


def test_alignment_variance_is_clamped_at_zero():
    # q < m^2 would give a negative variance: clamped, sigma = sqrt(eps)
    loss = sample_wise_alignment(
        np.zeros((1, 1)), np.array([2.0]), np.array([1.0]), np.zeros(1), np.zeros(1), 1.0, 1e-8
    )
    assert np.isfinite(loss).all()
    assert loss[0] == pytest.approx(4.0 + 1e-8)


def test_anchor_direction_points_to_anchor_with_gaussian_norm():
    rng = np.random.default_rng(0)
    theta, anchor = rng.standard_normal(400), rng.standard_normal(400)
    d_bar = anchor_direction(theta, anchor)
    assert np.linalg.norm(d_bar) == pytest.approx(np.sqrt(400), rel=1e-6)
    cosine = d_bar @ (anchor - theta) / (np.linalg.norm(d_bar) * np.linalg.norm(anchor - theta))
    assert cosine == pytest.approx(1.0)
    assert np.all(anchor_direction(anchor, anchor) == 0)


@pytest.mark.parametrize("batch,steps,expected", [(64, 10, 10), (1, 128, 2), (16, 8, 2), (8, 3, 0)])
def test_anchor_share_holds_at_any_batch_size(batch, steps, expected):
    share = AnchorShare(1.0)
    assert sum(share.take(batch) for _ in range(steps)) == expected


def test_anchor_share_never_exceeds_batch():
    share = AnchorShare(128.0)
    assert share.take(1) == 1 and share.take(4) == 4


def test_anchor_rows_are_anchor_direction_times_uniform():
    d_bar = np.linspace(-1, 1, 50).astype(np.float32)
    plan = PerturbationPlan.create(seed=3, step=7, rows=6, n_anchor=2, d_bar=d_bar)
    z = plan.draw()
    assert len(plan.anchor_rows) == 2
    for i in range(6):
        ratio = z[i][d_bar != 0] / d_bar[d_bar != 0]
        if i in plan.anchor_rows:
            assert np.all((ratio >= 0) & (ratio <= 2))
        else:
            assert np.any(ratio < 0)  # a Gaussian row is not a positive multiple of d_bar


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_regenerated_chunks_equal_one_draw(chunk):
    d_bar = np.ones(33, dtype=np.float32)
    plan = PerturbationPlan.create(seed=1, step=2, rows=8, n_anchor=3, d_bar=d_bar)
    whole = plan.draw()
    pieces = np.concatenate([z for _, z in plan.chunks(chunk)])
    np.testing.assert_array_equal(whole, pieces)
    again = PerturbationPlan.create(seed=1, step=2, rows=8, n_anchor=3, d_bar=d_bar).draw()
    np.testing.assert_array_equal(whole, again)
    other = PerturbationPlan.create(seed=1, step=3, rows=8, n_anchor=3, d_bar=d_bar).draw()
    assert not np.array_equal(whole, other)


@pytest.mark.parametrize("ahead_rows", [0, 2, 5, 8, 11])
@pytest.mark.parametrize("chunk", [3, 8])
def test_rows_drawn_ahead_equal_the_steps_own(ahead_rows, chunk):
    """Rows drawn ahead (fewer, as many or more than the plan's normal rows) and the stream
    continued after them give the Z of a plan that draws everything itself."""
    d_bar = np.linspace(-1, 1, 33).astype(np.float32)
    own = PerturbationPlan.create(seed=5, step=9, rows=8, n_anchor=3, d_bar=d_bar).draw()
    ahead = DrawnNormals.draw(5, 9, ahead_rows, 33)
    plan = PerturbationPlan.create(seed=5, step=9, rows=8, n_anchor=3, d_bar=d_bar, ahead=ahead)
    np.testing.assert_array_equal(np.concatenate([z for _, z in plan.chunks(chunk)]), own)
    np.testing.assert_array_equal(plan.draw(), own)


def test_rows_drawn_for_another_step_are_refused_or_dropped():
    d_bar = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="step 3"):
        PerturbationPlan.create(1, 2, 4, 0, d_bar, ahead=DrawnNormals.draw(1, 3, 4, 4)).draw()
    prefetch = NormalPrefetch()
    prefetch.start(seed=1, step=3, count=4, size=4)
    assert prefetch.take(seed=1, step=2, size=4) is None
    prefetch.start(seed=1, step=3, count=4, size=4)
    assert prefetch.take(seed=1, step=3, size=5) is None
    prefetch.start(seed=1, step=3, count=4, size=4)
    drawn = prefetch.take(seed=1, step=3, size=4)
    np.testing.assert_array_equal(drawn.rows, DrawnNormals.draw(1, 3, 4, 4).rows)
    assert prefetch.take(seed=1, step=3, size=4) is None
