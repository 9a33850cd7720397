"""The EVA-0 engine on a real exported model: estimator quality, update maths, state, guards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eva0_edge.runtime.engine import METHODS
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import InputError
from eva0_edge.runtime.state import StateError
from tests.fixtures import uniform_batch
from tests.timm_reference import load_timm

PLAIN_ENTROPY = {"shortcut_resistant": False, "center": False, "lambda_swa": 0.0}


def _true_entropy_gradient(exported, metadata, x: np.ndarray) -> np.ndarray:
    """d/dtheta of mean_i H(softmax(f_theta(x_i))) at theta0, by torch autograd on timm."""
    model = load_timm(exported.arch, exported.kwargs, exported.checkpoint)
    params = dict(model.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    slots = [params[s.name] for s in metadata.theta_layout]
    for p in slots:
        p.requires_grad_(True)
    logits = model(torch.from_numpy(x)).double()
    log_p = torch.log_softmax(logits, dim=1)
    entropy = -(log_p.exp() * log_p).sum(dim=1).mean()
    entropy.backward()
    return torch.cat([p.grad.reshape(-1) for p in slots]).numpy()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_two_sided_estimate_aligns_with_true_gradient(small_vit):
    """Averaged over many draws, the estimate points along the autograd gradient; at equal
    forwards, sample-wise perturbations align better than one batch-shared perturbation."""
    metadata = read_metadata(small_vit.onnx_path)
    x = uniform_batch(16, seed=5)
    true = _true_entropy_gradient(small_vit, metadata, x)
    results = {}
    for name, sample_wise in (("sample", True), ("shared", False)):
        model = Policy.load(
            small_vit.onnx_path, "eva0",
            {**PLAIN_ENTROPY, "sample_wise": sample_wise, "mu": 0.01}, seed=0, provider="cpu",
        )
        estimates = [model.model.estimate(x, step_index=i).grad for i in range(300)]
        results[name] = (
            _cosine(np.mean(estimates, axis=0), true),
            np.mean([_cosine(g, true) for g in estimates]),
        )
    averaged_sample, single_sample = results["sample"]
    averaged_shared, single_shared = results["shared"]
    assert averaged_sample > 0.8
    assert averaged_sample > averaged_shared
    assert single_sample > 1.5 * single_shared > 0


@pytest.mark.parametrize("method,forwards", [("eva0", 2), ("noadapt", 1), ("zoa", 2),
                                             ("spsa2-shared", 2), ("eva0-dagger", 2)])
def test_forwards_per_sample(small_vit, method, forwards):
    model = Policy.load(small_vit.onnx_path, method, provider="cpu")
    for seed in range(3):
        model.step(uniform_batch(8, seed))
    assert model.forwards_per_sample == forwards == METHODS[method].forwards_per_sample
    assert model.stats()["samples"] == 24


def test_short_stream_adapts_only_when_asked(calibrated_vit):
    theta0 = read_metadata(calibrated_vit).theta0
    drifts = {}
    for method in ("eva0", "noadapt", "zoa"):
        model = Policy.load(calibrated_vit, method, {"eta": 0.01}, provider="cpu")
        for seed in range(4):
            model.step(uniform_batch(8, seed))
        drifts[method] = np.linalg.norm(model.state.theta - theta0)
        # the file has source statistics: the alignment term keeps the paper's weight
        assert model.config.lambda_swa == 500.0
    assert drifts["noadapt"] == 0
    assert drifts["eva0"] > 0 and drifts["zoa"] > 0


def test_prediction_is_mean_of_the_two_sides(small_vit):
    """The served logits are the mean of the theta + mu z and theta - mu z rows of the one ORT
    call (recorded), which differ from each other and sit symmetrically about theta."""
    model = Policy.load(small_vit.onnx_path, "eva0", {"eta": 0.0, "gamma": 0.0},
                               provider="cpu")
    x = uniform_batch(4)
    calls = []
    run = model.session.run

    def recording(images, thetas):
        logits, features = run(images, thetas)
        calls.append((np.array(thetas), np.array(logits)))
        return logits, features

    model.session.run = recording
    served = model.step(x)
    (thetas, logits), = calls
    plus, minus = logits[:4], logits[4:]
    np.testing.assert_allclose(served, (plus + minus) / 2, rtol=1e-5, atol=1e-6)
    assert np.abs(plus - minus).max() > 1e-4
    centre = np.repeat(2 * model.state.theta[None], 4, axis=0)
    np.testing.assert_allclose(thetas[:4] + thetas[4:], centre, atol=1e-5)


@pytest.mark.parametrize("batch", [4, 64])
def test_relaxation_pulls_toward_anchor_per_reference_batch(small_vit, batch):
    """gamma is per 64 samples: a step of B keeps (1 - gamma)^(B / 64) of the offset."""
    model = Policy.load(small_vit.onnx_path, "eva0",
                               {"eta": 0.0, "gamma": 0.25, "anchor_per_64": 0.0},
                               provider="cpu")
    anchor = model.state.anchor.copy()
    start = anchor + 1.0
    model.state.theta = start.copy()
    model.step(uniform_batch(batch))
    keep = 0.75 ** (batch / 64)
    np.testing.assert_allclose(model.state.theta, keep * start + (1 - keep) * anchor, rtol=1e-6)


@pytest.mark.parametrize("batch", [4, 64])
def test_sgd_update_is_minus_eta_times_estimate_per_reference_batch(small_vit, batch):
    """eta is per 64 samples: a step of B moves theta by eta B / 64 times the estimate."""
    cfg = {"eta": 0.05, "gamma": 0.0, "anchor_per_64": 0.0, "coef_clip": None}
    model = Policy.load(small_vit.onnx_path, "eva0", cfg, provider="cpu")
    x = uniform_batch(batch)
    estimate = model.model.estimate(x)
    before = model.state.theta.astype(np.float64)
    model.step(x)
    expected = before - 0.05 * batch / 64 * estimate.grad
    np.testing.assert_allclose(model.state.theta, expected, atol=1e-6)


def test_batch_one_gets_its_anchor_row_every_64_steps(small_vit):
    model = Policy.load(small_vit.onnx_path, "eva0", {"eta": 0.01}, provider="cpu")
    seen = []
    x = uniform_batch(1)
    for _ in range(128):
        model.step(x)
        seen.append(model.last.anchor_rows)
    assert sum(seen) == 2
    assert [i for i, n in enumerate(seen) if n] == [63, 127]


def test_runs_are_reproducible_under_a_seed(small_vit):
    def run(seed):
        model = Policy.load(small_vit.onnx_path, "eva0", {"eta": 0.01}, seed=seed,
                                   provider="cpu")
        outs = [model.step(uniform_batch(8, s)) for s in range(3)]
        return model.state.theta, np.concatenate(outs)

    theta_a, out_a = run(7)
    theta_b, out_b = run(7)
    theta_c, _ = run(8)
    np.testing.assert_array_equal(theta_a, theta_b)
    np.testing.assert_array_equal(out_a, out_b)
    assert not np.array_equal(theta_a, theta_c)


def test_regenerated_perturbations_equal_stored_ones(calibrated_vit):
    results = []
    for regenerate in (False, True):
        model = Policy.load(calibrated_vit, "eva0",
                                   {"eta": 0.01, "regenerate_z": regenerate, "anchor_per_64": 16},
                                   provider="cpu")
        for s in range(3):
            model.step(uniform_batch(20, s))
        results.append(model.state.theta)
    np.testing.assert_allclose(results[0], results[1], atol=1e-7)


def test_prefetched_perturbations_give_the_same_run(calibrated_vit):
    """Drawing the next step's rows during this step's ORT call changes no number: batch sizes
    that change (the drawn-ahead rows too few or too many), anchor rows, a shared z."""
    batches = [8, 8, 3, 16, 1, 1, 8]
    for config in ({"anchor_per_64": 16}, {"sample_wise": False}):
        runs = []
        for prefetch in (False, True):
            model = Policy.load(calibrated_vit, "eva0", {"eta": 0.01, **config}, seed=4,
                                       prefetch=prefetch, provider="cpu")
            assert (model.model.estimator.prefetch is not None) == prefetch
            outs = [model.step(uniform_batch(b, s)) for s, b in enumerate(batches)]
            if prefetch:  # every step after the first took its rows from the one before
                assert model.model.estimator.prefetch.hits == len(batches) - 1
            runs.append((model.state.theta.copy(), np.concatenate(outs)))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        assert not np.array_equal(runs[0][0], read_metadata(calibrated_vit).theta0)


def test_state_round_trip_gives_identical_next_step(calibrated_vit, tmp_path):
    cfg = {"eta": 0.01, "momentum": 0.9, "balance_beta": 0.9}
    model = Policy.load(calibrated_vit, "eva0", cfg, seed=3, provider="cpu")
    for s in range(3):
        model.step(uniform_batch(8, s))
    model.save_state(tmp_path / "state.npz")
    expected_logits = model.step(uniform_batch(8, 10))
    expected_theta = model.state.theta.copy()

    fresh = Policy.load(calibrated_vit, "eva0", cfg, seed=0, provider="cpu")
    fresh.load_state(tmp_path / "state.npz")
    np.testing.assert_array_equal(fresh.step(uniform_batch(8, 10)), expected_logits)
    np.testing.assert_array_equal(fresh.state.theta, expected_theta)

    other = Policy.load(calibrated_vit, "eva0", cfg, provider="cpu")
    other.load_state_dict(model.state_dict())
    assert other.state.step == model.state.step
    assert other.state_dict()["anchor_credit"] == model.state_dict()["anchor_credit"] > 0


def test_corrupt_or_foreign_state_is_refused(calibrated_vit, small_resnet_gn, tmp_path):
    model = Policy.load(calibrated_vit, "eva0", provider="cpu")
    model.step(uniform_batch(4))
    path = model.save_state(tmp_path / "state.npz")
    data = bytearray(path.read_bytes())
    (tmp_path / "truncated.npz").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(StateError):
        model.load_state(tmp_path / "truncated.npz")
    foreign = Policy.load(small_resnet_gn.onnx_path, "eva0", provider="cpu")
    with pytest.raises(StateError, match="another model"):
        foreign.load_state(path)
    bad = model.state_dict()
    bad["theta"] = bad["theta"][:-1]
    before = model.state.theta.copy()
    with pytest.raises(StateError, match="theta"):
        model.load_state_dict(bad)
    np.testing.assert_array_equal(model.state.theta, before)


def test_reset_restores_source(calibrated_vit):
    model = Policy.load(calibrated_vit, "eva0", {"eta": 0.05}, provider="cpu")
    model.step(uniform_batch(8))
    assert model.stats()["drift"] > 0
    model.reset()
    assert model.stats()["drift"] == 0 and model.state.step == 0


@pytest.mark.parametrize(
    "bad,match",
    [
        (np.zeros((2, 3, 16, 16), np.float32), "shape"),
        (np.zeros((2, 32, 32, 3), np.float32), "shape"),
        (np.zeros((0, 3, 32, 32), np.float32), "empty"),
        (np.zeros((2, 3, 32, 32), np.uint8), "floating"),
        (np.full((2, 3, 32, 32), np.nan, np.float32), "NaN"),
        (np.where(np.arange(6144).reshape(2, 3, 32, 32) == 77, np.nan, 0).astype(np.float32),
         "NaN"),
        (np.where(np.arange(6144).reshape(2, 3, 32, 32) == 5, np.inf, 0).astype(np.float32),
         "infinite"),
        (np.where(np.arange(6144).reshape(2, 3, 32, 32) == 5, -np.inf, 0).astype(np.float32),
         "infinite"),
        (np.full((2, 3, 32, 32), 255.0, np.float32), "range"),
        ([[0.0]], "numpy array"),
    ],
)
@pytest.mark.parametrize("method, config", [("eva0", {"eta": 0.05}), ("eva0", {"budget": 1.0})],
                         ids=["step", "served"])
def test_bad_input_is_refused_before_any_state_change(calibrated_vit, bad, match, method,
                                                       config):
    """On the method's step and on a batch the budget serves: refused, nothing learnt."""
    model = Policy.load(calibrated_vit, method, config, provider="cpu")
    model.step(uniform_batch(4))
    before = model.state_dict()
    with pytest.raises(InputError, match=match):
        model.step(bad)
    after = model.state_dict()
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value)


def test_non_finite_update_is_skipped_and_counted(calibrated_vit, monkeypatch):
    model = Policy.load(calibrated_vit, "eva0", {"eta": 1e300}, provider="cpu")
    model.state.theta = model.state.theta + 1.0  # off the anchor so the step is large
    theta = model.state.theta.copy()
    model.step(uniform_batch(4))
    assert model.stats()["skipped_steps"] == 1
    np.testing.assert_array_equal(model.state.theta, theta)

    model = Policy.load(calibrated_vit, "eva0", provider="cpu")
    run = model.session.run

    def nan_logits(x, rows):
        logits, features = run(x, rows)
        logits[0, 0] = np.nan
        return logits, features

    monkeypatch.setattr(model.session, "run", nan_logits)
    model.step(uniform_batch(4))
    assert model.state.skipped == 1 and not model.state.moments_ready
    np.testing.assert_array_equal(model.state.theta, read_metadata(calibrated_vit).theta0)


def test_unknown_method_and_hyper_parameter(small_vit):
    with pytest.raises(ValueError, match="unknown method"):
        Policy.load(small_vit.onnx_path, "tent")
    with pytest.raises(ValueError, match="unknown hyper-parameter"):
        Policy.load(small_vit.onnx_path, "eva0", {"learning_rate": 1})


def test_metadata_recommendations_override_defaults(small_vit):
    model = Policy.load(small_vit.onnx_path, "eva0", provider="cpu")
    assert model.config.alpha == 0.9  # ViT recommendation from the export
    assert model.config.lambda_swa == 0.0  # no source statistics in this file
    overridden = Policy.load(small_vit.onnx_path, "eva0", {"alpha": 0.5}, provider="cpu")
    assert overridden.config.alpha == 0.5


def test_providers_resolve_and_missing_cuda_is_a_clear_error(small_vit):
    import onnxruntime as ort

    from eva0_edge.runtime.session import resolve_providers

    assert resolve_providers("cpu") == ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert resolve_providers("auto")[0] == "CUDAExecutionProvider"
    else:
        assert resolve_providers("auto") == ["CPUExecutionProvider"]
        with pytest.raises(ValueError, match="not available"):
            Policy.load(small_vit.onnx_path, "eva0", provider="cuda")
    with pytest.raises(ValueError, match="unknown provider"):
        resolve_providers("tpu")


def test_low_memory_runs_the_same_steps(calibrated_vit):
    """Two ORT calls of N rows (low_memory) give the one call's logits, theta and counts."""
    one = Policy.load(calibrated_vit, "eva0", seed=3, provider="cpu")
    two = Policy.load(calibrated_vit, "eva0", seed=3, provider="cpu", low_memory=True)
    for step in range(4):
        x = uniform_batch(8, seed=step)
        np.testing.assert_allclose(two.step(x), one.step(x), atol=1e-5)
    np.testing.assert_allclose(two.state.theta, one.state.theta, atol=1e-6)
    assert two.stats()["forwards"] == one.stats()["forwards"] == 4 * 16
