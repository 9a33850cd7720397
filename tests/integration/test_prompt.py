"""Black-box prompt mode: the exporter's prompt input, EVA-0-clubs and FOA / FOA-dagger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from eva0_edge.runtime.foa import FOAModel
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from tests.component.test_prompt import batch
from tests.fixtures import SHIPPED_VIT


def torch_prompt_model(exported):
    import timm
    import torch

    from eva0_edge.exporter.prompt import PromptModel

    model = timm.create_model(exported.arch, **exported.kwargs).eval()
    model.load_state_dict(torch.load(exported.checkpoint, weights_only=True))
    return PromptModel(model).eval()


def test_prompt_export_is_a_black_box_with_a_prompt_input(prompt_vit):
    md = read_metadata(prompt_vit.onnx_path)
    session = ort.InferenceSession(str(prompt_vit.onnx_path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert set(inputs) == {"pixel_values", "prompt", "head_shift"}
    assert inputs["prompt"][1:] == [2, 64]
    assert md.is_prompt_model and md.black_box and md.theta_layout[0].shape == (2, 64)
    assert set(md.arrays) == {  # statistics only (the shift's per-class means): no weights
        "theta0", "source_mean", "source_std", "head_input_mean", "head_input_class_means"}
    assert md.feature_layout[-1].name == "head_input" and md.num_features == 7 * 64
    bound = np.sqrt(6 / (3 * 16 + 64))  # VPT/FOA's uniform initialisation
    assert 0.5 * bound < np.abs(md.theta0).max() <= bound


def test_prompt_input_changes_the_output_as_the_torch_model_does(prompt_vit):
    import torch

    md = read_metadata(prompt_vit.onnx_path)
    session = ort.InferenceSession(str(prompt_vit.onnx_path), providers=["CPUExecutionProvider"])
    x = batch(3)
    rng = np.random.default_rng(1)
    prompts = np.stack([md.theta0.reshape(2, 64), rng.normal(0, 1, (2, 64))]).astype(np.float32)
    rows = np.repeat(prompts, 3, axis=0)  # copy-major: 3 images under prompt 0, then prompt 1
    shift = rng.normal(0, 1, (1, 64)).astype(np.float32)
    logits, features, shifted = session.run(
        None, {"pixel_values": x, "prompt": rows, "head_shift": shift}
    )
    assert np.abs(logits[:3] - logits[3:]).max() > 1e-2  # the prompt matters
    reference = torch_prompt_model(prompt_vit)
    with torch.no_grad():
        want = reference(torch.from_numpy(x).repeat(2, 1, 1, 1), torch.from_numpy(rows),
                         torch.from_numpy(shift))
    for got, expected in zip((logits, features, shifted), want, strict=True):
        np.testing.assert_allclose(got, expected.numpy(), atol=2e-4, rtol=1e-4)
    zero = np.zeros_like(shift)
    unshifted = session.run(["shifted_logits"], {"pixel_values": x, "prompt": rows,
                                                 "head_shift": zero})[0]
    np.testing.assert_allclose(unshifted, logits, atol=1e-5)


@pytest.mark.parametrize("fp", [2, 8])
def test_eva0_clubs_honours_the_forward_budget(prompt_vit, fp):
    model = Policy.load(prompt_vit.onnx_path, f"eva0-clubs@{fp}", seed=0,
                               provider="cpu")
    assert model.config.lambda_swa == 0.0 and model.config.forwards == fp
    x = batch(5)
    for _ in range(3):
        logits = model.step(x)
    assert logits.shape == (5, 10)
    assert model.forwards_per_sample == fp
    assert model.stats()["drift"] > 0  # the prompt moved


def test_more_pairs_average_the_estimate(prompt_vit):
    """#FP = 2q averages q pair estimates: the q = 4 estimate is the mean of its pairs, so on a
    fixed batch it varies less across perturbation draws than a single pair's."""
    x = batch(4)

    def spread(fp: int) -> float:
        model = Policy.load(prompt_vit.onnx_path, f"eva0-clubs@{fp}", provider="cpu")
        grads = np.stack([model.model.estimate(x, step_index=i).grad for i in range(12)])
        return float(np.linalg.norm(grads - grads.mean(0), axis=1).mean())

    assert spread(8) < 0.8 * spread(2)


def test_bad_forward_budgets_and_models_are_refused(prompt_vit, small_vit):
    with pytest.raises(ValueError, match="even number"):
        Policy.load(prompt_vit.onnx_path, "eva0-clubs@3", provider="cpu")
    with pytest.raises(ValueError, match="even number"):
        Policy.load(small_vit.onnx_path, "zoa@4", provider="cpu")
    with pytest.raises(ValueError, match="part after @"):
        Policy.load(prompt_vit.onnx_path, "eva0-clubs@x", provider="cpu")
    with pytest.raises(ValueError, match="--prompts"):
        Policy.load(small_vit.onnx_path, "eva0-clubs", provider="cpu")
    with pytest.raises(ValueError, match="--prompts"):
        Policy.load(small_vit.onnx_path, "foa", provider="cpu")


@pytest.mark.parametrize(("method", "fp"), [("foa", 28), ("foa-dagger@6", 6), ("foa@2", 2)])
def test_foa_honours_the_forward_budget(prompt_vit, method, fp):
    model = Policy.load(prompt_vit.onnx_path, method, provider="cpu")
    assert isinstance(model.model, FOAModel)
    for _ in range(2):
        logits = model.step(batch(3))
    assert logits.shape == (3, 10)
    assert model.stats()["forwards_per_sample"] == fp


@pytest.fixture(scope="module")
def wide_prompt_vit(tmp_path_factory) -> Path:
    """A 576-dimension prompt (ViT width 192, 3 tokens, 2 blocks), calibrated on 64
    Fashion-MNIST images: where small CMA-ES populations broke."""
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
    from eva0_edge.runtime.calibrate import calibrate_with_images
    from tests.fixtures import export_small

    kwargs = {"img_size": 32, "patch_size": 4, "embed_dim": 192, "depth": 2, "num_heads": 3,
              "num_classes": 10}
    exported = export_small(tmp_path_factory.mktemp("wide"), "vit_tiny_patch16_224", kwargs,
                            prompts=3)
    calibrate_with_images(exported.onnx_path, load_fashion_mnist("test")[0][:64])
    return exported.onnx_path


@pytest.mark.parametrize("forwards", [2, 3, 4, 5, 8])
def test_every_population_keeps_searching(wide_prompt_vit, forwards):
    """K = 2-4 broke inside cma within 8 batches of 64 (unused injected directions at 2, NaN
    covariance eigenvalues at 3 and 4); every K runs."""
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
    from eva0_edge.runtime.preprocess import preprocess_uint8

    model = Policy.load(wide_prompt_vit, f"foa@{forwards}", provider="cpu")
    x = preprocess_uint8(load_fashion_mnist("test")[0][64:576], model.metadata.preprocessing)
    for start in range(0, len(x), 64):
        model.step(x[start : start + 64])
    assert np.isfinite(model.model.best_fitness)
    assert model.stats()["forwards_per_sample"] == forwards


@pytest.mark.integration  # Fashion-MNIST
def test_cma_es_improves_the_fitness_on_a_fixed_batch():
    """On the shipped ViT's prompt variant and 32 noisy test images, FOA-dagger's best fitness
    never rises (the previous best is re-evaluated) and falls well below the initial prompt's."""
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
    from eva0_edge.bench.testbed.prompt_variant import prompt_variant

    model = Policy.load(prompt_variant(SHIPPED_VIT), "foa-dagger@10", seed=0, provider="cpu")
    pre = model.metadata.preprocessing
    images = load_fashion_mnist("test")[0][:32].astype(np.float32) / 255.0
    noisy = np.clip(images + np.random.default_rng(0).normal(0, 0.3, images.shape), 0, 1)
    x = ((noisy - np.array(pre.mean)) / np.array(pre.std)).transpose(0, 3, 1, 2)
    x = x.astype(np.float32)
    logits, features = model.session.run(x, np.tile(model.metadata.theta0, (32, 1)))
    initial = float(model.model.fitness(logits[None].astype(np.float64),
                                  features[None].astype(np.float64))[0])
    best = []
    for _ in range(15):
        model.step(x)
        best.append(model.model.best_fitness)
    assert all(b <= a + 1e-6 for a, b in zip(best, best[1:], strict=False))  # elitist
    assert best[-1] < 0.8 * initial


def test_foa_reads_its_tuned_values_from_the_model_file(prompt_vit, tmp_path):
    from eva0_edge.runtime.modelfile import load_onnx, save_onnx, set_metadata

    model = load_onnx(prompt_vit.onnx_path)
    metadata = read_metadata(model)
    metadata.tuned = {**metadata.tuned, "foa": {"lambda_fit": 1.6}}
    tuned = tmp_path / "tuned.onnx"
    save_onnx(set_metadata(model, metadata), tuned)
    assert Policy.load(tuned, "foa", provider="cpu").config.lambda_fit == 1.6
    assert Policy.load(tuned, "foa", {"lambda_fit": 0.2}, provider="cpu").config.lambda_fit == 0.2
    assert Policy.load(tuned, "foa-dagger", provider="cpu").config.lambda_fit == 0.0


def test_foa_shifts_activations_toward_the_source_mean(prompt_vit):
    model = Policy.load(prompt_vit.onnx_path, "foa", provider="cpu")
    x = batch(8)
    model.step(x)
    shift = model.model.head_shift()
    head = model.model.head_features
    expected = model.metadata.arrays["source_mean"][head] - model.model.test_mean
    np.testing.assert_allclose(shift, expected, rtol=1e-5, atol=1e-6)
    logits = model.step(x)  # the returned logits are the best candidate's shifted ones
    prompt = np.broadcast_to(model.model.best_prompt, (8, model.model.best_prompt.size))
    _, _, shifted = model.session.run_shifted(x, prompt, shift)
    np.testing.assert_allclose(logits, shifted, atol=1e-4)
    dagger = Policy.load(prompt_vit.onnx_path, "foa-dagger", provider="cpu")
    dagger.step(x)
    assert not dagger.model.head_shift().any()


def test_foa_reset_restores_the_initial_prompt(prompt_vit):
    model = Policy.load(prompt_vit.onnx_path, "foa", provider="cpu")
    x = batch(4)
    first = model.step(x)
    model.step(x)
    model.reset()
    np.testing.assert_array_equal(model.model.best_prompt, model.metadata.theta0)
    np.testing.assert_allclose(model.step(x), first, atol=1e-6)  # same seed, same draws


def test_foa_warns_once_on_batches_too_small_for_its_statistics(prompt_vit, caplog):
    model = Policy.load(prompt_vit.onnx_path, "foa@5", provider="cpu")
    with caplog.at_level("WARNING", logger="eva0_edge.runtime.foa"):
        model.step(batch(8))
        assert not caplog.records
        model.step(batch(1))
        model.step(batch(1))
    assert len(caplog.records) == 1 and "fewer than 4 images" in caplog.text


def test_quantize_refuses_a_prompt_model(prompt_vit, tmp_path):
    from eva0_edge.quant import quantize_model

    with pytest.raises(ValueError, match="prompt model"):
        quantize_model(prompt_vit.onnx_path, tmp_path / "q.onnx", 8, batch(4))


@pytest.mark.integration
def test_export_cli_prompt_mode_and_info(tmp_path, capsys):
    from eva0_edge.cli import main

    out = tmp_path / "p.onnx"
    assert main(["export", "--arch", "vit_tiny_patch16_224", "--set", "img_size=32",
                 "--set", "patch_size=8", "--set", "depth=2", "--set", "num_classes=10",
                 "--prompts", "4", "-o", str(out)]) == 0
    assert "black-box prompt [R, 4, 192]" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    assert "black box: prompt [R, 4, 192] after CLS" in capsys.readouterr().out
    # FOA keeps its CMA-ES in memory: serving it with a state directory is refused
    assert main(["serve", "--model", str(out), "--method", "foa-dagger", "--state-dir",
                 str(tmp_path / "state")]) == 2
    assert "not persisted" in capsys.readouterr().err


def test_foa_under_a_budget_adapts_on_its_share_of_batches(prompt_vit):
    """foa@5 at budget 2 in the controller's settled schedule: a search (5 forwards) on a
    quarter of the batches, one forward on the rest, 2 forwards per sample on the counter;
    the served batches move the shifting's EMA, not the search."""
    model = Policy.load(prompt_vit.onnx_path, "foa@5", {"budget": 2.0}, provider="cpu")
    model.budget.dense = False  # a stream already learnt: search whenever the bucket is full
    for i in range(40):
        model.step(batch(8, seed=i % 2))
    assert model.session.counter.per_sample == pytest.approx(2.0)
    assert model.model.steps == 10
    stats = model.stats()["budget"]
    assert (stats["adapted_samples"], stats["served_samples"]) == (80, 240)


def test_foa_at_budget_one_serves_the_initial_prompt_with_its_shifting(prompt_vit):
    """Budget 1: no search, one forward per sample under the initial prompt, and the head
    inputs of every served batch enter the EMA (FOA's activation shift alone)."""
    from eva0_edge.runtime.session import AdaptableSession

    model = Policy.load(prompt_vit.onnx_path, "foa", {"budget": 1.0}, provider="cpu")
    reference = AdaptableSession(prompt_vit.onnx_path, None, "cpu")
    theta0, a = model.metadata.theta0, model.config.shift_alpha
    prompts = np.broadcast_to(theta0, (8, theta0.size))
    ema = None
    for i in range(3):
        x = batch(8, seed=i)
        shift = model.model.head_shift()
        logits = model.step(x)
        _, features, shifted = reference.run_shifted(x, prompts, shift)
        np.testing.assert_allclose(logits, shifted, atol=1e-4)
        head = features[:, model.model.head_features].astype(np.float64).mean(axis=0)
        ema = head if ema is None else (1 - a) * ema + a * head
        np.testing.assert_allclose(model.model.test_mean, ema, rtol=1e-5, atol=1e-7)
    assert model.model.steps == 0 and model.session.counter.per_sample == 1.0
    np.testing.assert_array_equal(model.model.best_prompt, theta0)


def test_foa_budget_out_of_range_is_refused(prompt_vit):
    with pytest.raises(ValueError, match="budget must be between 1 and the method's 28"):
        Policy.load(prompt_vit.onnx_path, "foa", {"budget": 29.0}, provider="cpu")


def test_foa_needs_source_statistics_and_foa_dagger_does_not(tmp_path):
    from tests.fixtures import SMALL_VIT, export_small

    bare = export_small(tmp_path, *SMALL_VIT, prompts=1)
    with pytest.raises(ValueError, match="calibrate"):
        Policy.load(bare.onnx_path, "foa", provider="cpu")
    Policy.load(bare.onnx_path, "foa-dagger", provider="cpu").step(batch(2))
