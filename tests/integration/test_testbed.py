"""The Fashion-MNIST-C testbed: data, corruptions, shipped models, protocols, eval end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eva0_edge.bench.testbed.corruptions import CORRUPTIONS, corrupt_images
from eva0_edge.bench.testbed.datasets import Domain, folder_domains
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist, train_val_indices
from eva0_edge.bench.testbed.protocols import run_protocol, stream_order
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from tests.fixtures import SHIPPED


def test_loader_shapes_and_labels():
    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 32, 32, 3) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [1000] * 10
    assert x[:, :2].max() == 0 and x[:, :, -2:].max() == 0  # 2-pixel zero padding
    np.testing.assert_array_equal(x[..., 0], x[..., 2])  # grey repeated to RGB
    train, val = train_val_indices()
    assert len(train) == 55000 and len(val) == 5000 and not set(train) & set(val)


def test_bad_split_and_missing_data(tmp_path):
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation")
    with pytest.raises(FileNotFoundError, match="apt-get install"):
        load_fashion_mnist("test", root=tmp_path)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corruptions_are_deterministic_under_a_seed(name):
    images, _ = load_fashion_mnist("test")
    sample = images[:6]
    first = corrupt_images(sample, name, 5, seed=11)
    assert first.shape == sample.shape and first.dtype == np.uint8
    np.testing.assert_array_equal(first, corrupt_images(sample, name, 5, seed=11))
    # image i depends on (seed, index) only: a chunk starting at index 3 agrees
    np.testing.assert_array_equal(first[3:], corrupt_images(sample[3:], name, 5, 11, 3))
    assert not np.array_equal(first, sample)


def test_subset_generation_matches_full_split_pixels():
    images, _ = load_fashion_mnist("test")
    full = corrupt_images(images[:12], "snow", 4, seed=5)
    picked = np.array([2, 7, 11])
    subset = corrupt_images(images[picked], "snow", 4, seed=5, indices=picked)
    np.testing.assert_array_equal(subset, full[picked])


def test_corruption_seed_changes_random_corruptions():
    images, _ = load_fashion_mnist("test")
    a = corrupt_images(images[:4], "gaussian_noise", 3, seed=1)
    b = corrupt_images(images[:4], "gaussian_noise", 3, seed=2)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("model_path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_models_are_small_and_calibrated(model_path):
    metadata = read_metadata(model_path)
    assert model_path.stat().st_size <= 10 * 2**20
    assert metadata.has_source_stats
    assert metadata.labels[0] == "t-shirt/top" and metadata.num_classes == 10
    assert {"eta", "lambda_swa", "rho"} <= set(metadata.recommended)


@pytest.mark.parametrize("model_path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_models_reach_90_percent_on_the_clean_test_split(model_path):
    from eva0_edge.runtime.preprocess import preprocess_uint8

    images, labels = load_fashion_mnist("test")
    model = Policy.load(model_path, "noadapt", provider="cpu")
    correct = sum(
        int((model.predict(preprocess_uint8(images[i : i + 1000], model.metadata.preprocessing))
             .argmax(1) == labels[i : i + 1000]).sum())
        for i in range(0, len(images), 1000)
    )
    assert correct / len(images) >= 0.90


@pytest.mark.parametrize("model_path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_model_accuracy_drops_with_severity(model_path):
    images, labels = load_fashion_mnist("test")
    rng = np.random.default_rng(0)
    idx = rng.choice(len(images), 150, replace=False)
    model = Policy.load(model_path, "noadapt", provider="cpu")
    from eva0_edge.runtime.preprocess import preprocess_uint8

    clean = (model.predict(preprocess_uint8(images[idx], model.metadata.preprocessing))
             .argmax(1) == labels[idx]).mean()
    assert clean >= 0.85
    means = []
    for severity in (1, 3, 5):
        accs = []
        for name in CORRUPTIONS:
            x = corrupt_images(images[idx], name, severity, seed=3)
            pred = model.predict(preprocess_uint8(x, model.metadata.preprocessing)).argmax(1)
            accs.append((pred == labels[idx]).mean())
        means.append(float(np.mean(accs)))
    assert clean > means[0] > means[1] > means[2]


def test_stream_orders():
    labels = np.repeat(np.arange(5), 20)
    domain = Domain("d", 5, labels, images=np.zeros((100, 32, 32, 3), np.uint8))
    shuffled = stream_order(domain, "single", 0)
    assert sorted(shuffled.tolist()) == list(range(100))
    assert np.array_equal(shuffled, stream_order(domain, "continual", 0))
    sorted_labels = labels[stream_order(domain, "imbalanced", 0)]
    assert np.all(np.diff(sorted_labels) >= 0)


class _Counter:
    """A fake method that records resets and predicts class 0."""

    def __init__(self):
        self.resets = 0

    def step(self, x):
        return np.eye(10)[np.zeros(len(x), dtype=int)]

    def reset(self):
        self.resets += 1


@pytest.mark.parametrize("protocol,resets", [("single", 2), ("continual", 0), ("imbalanced", 2)])
def test_protocol_resets(protocol, resets):
    from eva0_edge.runtime.metadata import Preprocessing

    pre = Preprocessing((3, 32, 32), (0.5,) * 3, (0.5,) * 3)
    labels = np.array([0, 1, 0, 1])
    domains = [Domain(n, 5, labels, images=np.zeros((4, 32, 32, 3), np.uint8))
               for n in ("a", "b", "c")]
    method = _Counter()
    result = run_protocol("fake", lambda: method, domains, protocol, 3, pre, progress=False)
    assert method.resets == resets
    assert result.accuracy == {"a": 50.0, "b": 50.0, "c": 50.0}
    assert sum(result.batch_size) == 12


def test_folder_dataset_tree(tmp_path):
    from PIL import Image

    for corruption in ("fog", "contrast"):
        for cls in ("n01", "n02"):
            folder = tmp_path / corruption / "5" / cls
            folder.mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (40, 40), (i * 50, 0, 0)).save(folder / f"{i}.png")
    domains = folder_domains(tmp_path, 5)
    assert [d.name for d in domains] == ["fog", "contrast"]  # ImageNet-C order
    assert domains[0].labels.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="no <corruption>/3/"):
        folder_domains(tmp_path, 3)


@pytest.mark.parametrize(
    "protocol,batch_size,methods",
    [
        ("single", 64, "noadapt,eva0,tent"),
        ("continual", 32, "eva0,zoa,sar"),
        ("imbalanced", 64, "eva0-dagger,deyo,spsa2-shared"),
        ("single", 1, "noadapt,eva0"),
        ("single", 16, "noadapt,foa@5,foa-dagger@5,eva0-clubs@4"),
    ],
)
def test_eval_end_to_end(tmp_path, protocol, batch_size, methods):
    from eva0_edge.cli import main

    out = tmp_path / "report"
    limit = 8 if batch_size == 1 else 64
    assert main(["eval", "--model", str(SHIPPED[0]), "--protocol", protocol, "--severity", "5",
                 "--batch-size", str(batch_size), "--methods", methods, "--limit", str(limit),
                 "--out", str(out), "-q"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert list(report["results"]) == methods.split(",")
    for name, result in report["results"].items():
        assert list(result["accuracy"]) == list(CORRUPTIONS)
        assert 0 <= result["average"] <= 100
        if "@" in name:  # the prompt methods ran on the shipped ViT's prompt variant
            assert result["forwards_per_sample"] == int(name.split("@")[1])
    assert (out / "stream.png").stat().st_size > 10_000
    assert (out / "pareto.png").stat().st_size > 10_000
    assert f"Pareto front, B = {batch_size}:" in (out / "results.md").read_text()
    assert "| method |" in (out / "results.md").read_text()


def test_eval_keeps_the_guards_routine_messages_for_verbose(caplog):
    """Trips and verdicts are routine on a hostile stream and the report counts them: ``eval``
    logs them only with ``-v`` (the ViT trips within 64 images of Gaussian noise 0.5)."""
    from eva0_edge.cli import main

    args = ["eval", "--model", str(SHIPPED[0]), "--protocol", "continual", "--corruptions",
            "gauss-0.5,clean", "--batch-size", "1", "--limit", "150", "--methods", "eva0",
            "--threads", "1", "-q"]

    def guard_messages() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "eva0_edge.runtime.policy" and "health guard" in r.getMessage()]

    assert main(args) == 0
    assert guard_messages() == []
    assert main(["-v", *args]) == 0
    assert any("health guard tripped" in m for m in guard_messages())


def test_eval_sweeps_batch_sizes_on_the_clean_domain(tmp_path):
    """``--batch-sizes`` gives one report with a row per method and batch size;
    ``--corruptions clean`` is the uncorrupted images (NoAdapt's accuracy is the same at every
    batch size and equals the plain prediction on those images)."""
    from eva0_edge.cli import main

    out = tmp_path / "sweep"
    assert main(["eval", "--model", str(SHIPPED[1]), "--corruptions", "clean",
                 "--batch-sizes", "1,4", "--methods", "noadapt,eva0", "--limit", "12",
                 "--out", str(out), "-q"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert list(report["results"]) == ["noadapt B=1", "eva0 B=1", "noadapt B=4", "eva0 B=4"]
    rows = report["results"]
    assert [r["batch_size"] for r in rows.values()] == [1, 1, 4, 4]
    assert all(list(r["accuracy"]) == ["clean"] for r in rows.values())
    assert rows["noadapt B=1"]["average"] == rows["noadapt B=4"]["average"]
    assert rows["eva0 B=1"]["final_stats"]["steps"] == 12
    assert "| eva0 | 4 |" in (out / "results.md").read_text()
    assert main(["eval", "--model", str(SHIPPED[1]), "--corruptions", "fog,sunshine",
                 "--limit", "4", "-q"]) == 2


def test_the_sensor_fault_sweep_is_labelled_levelled_and_seeded():
    """``gauss-S`` adds noise of std S (255 S on uint8, less where clipped), ``blur-R`` removes
    detail, ``jpeg-Q`` is lossy; labels are the clean images'; a bad level is refused."""
    from eva0_edge.bench.testbed.datasets import TEST_SEED, fmnist_c_domains
    from eva0_edge.bench.testbed.hostile import NOISE_SWEEP, hostile_images

    indices = np.arange(64)
    clean = fmnist_c_domains(5, "test", corruptions=["clean"], indices=indices,
                             progress=False)[0]
    domains = {d.name: d for d in fmnist_c_domains(5, "test", corruptions=NOISE_SWEEP,
                                                   indices=indices, progress=False)}
    for name, domain in domains.items():
        assert (domain.labels == clean.labels).all() and not domain.ordered, name
    residual = domains["gauss-0.1"].images.astype(float) - clean.images
    mid_grey = (clean.images >= 80) & (clean.images <= 175)  # 3 std from clipping
    assert 24.5 < residual[mid_grey].std() < 26.5  # 0.1 x 255 = 25.5
    assert domains["gauss-0.5"].images.std() > domains["gauss-0.1"].images.std()

    def detail(images: np.ndarray) -> float:
        return float(np.abs(np.diff(images.astype(float), axis=1)).mean())

    assert detail(domains["blur-2"].images) < detail(domains["blur-1"].images) < detail(
        clean.images)
    assert np.abs(domains["jpeg-5"].images.astype(float) - clean.images).mean() > np.abs(
        domains["jpeg-20"].images.astype(float) - clean.images).mean() > 0
    again, _ = hostile_images("gauss-0.3", clean.images, clean.labels, seed=TEST_SEED)
    other, _ = hostile_images("gauss-0.3", clean.images, clean.labels, seed=TEST_SEED + 1)
    assert (again == domains["gauss-0.3"].images).all() and (again != other).any()
    for bad in ("gauss-x", "gauss-0", "jpeg-200", "jpeg-2.5"):
        with pytest.raises(ValueError, match=bad):
            hostile_images(bad, clean.images, clean.labels, seed=0)


def test_hostile_streams_and_the_soak_protocol(tmp_path):
    """Hostile domains keep their order and leave unlabelled frames unscored; the soak runs the
    continual stream ten times without reset and reports every pass."""
    from eva0_edge.bench.testbed.datasets import fmnist_c_domains
    from eva0_edge.bench.testbed.hostile import HOSTILE
    from eva0_edge.bench.testbed.protocols import stream_order
    from eva0_edge.cli import main

    indices = np.arange(120)
    domains = {d.name: d for d in fmnist_c_domains(5, "test", corruptions=HOSTILE,
                                                   indices=indices, progress=False)}
    assert (domains["black"].images == 0).all() and (domains["black"].labels == -1).all()
    assert (domains["white"].images == 255).all()
    assert (domains["repeat"].images == domains["repeat"].images[0]).all()
    assert (domains["noise"].labels == -1).all() and domains["noise"].images.std() > 50
    burst = domains["burst"]
    assert (np.diff(burst.labels) >= 0).all()
    assert stream_order(burst, "continual", 0).tolist() == list(range(120))
    alternate = domains["alternate"]
    clean = fmnist_c_domains(5, "test", corruptions=["clean"], indices=indices,
                             progress=False)[0]
    assert (alternate.images[:50] == clean.images[:50]).all()
    assert not (alternate.images[50:100] == clean.images[50:100]).all()

    out = tmp_path / "soak"
    assert main(["eval", "--model", str(SHIPPED[1]), "--protocol", "soak", "--corruptions",
                 "black,clean", "--limit", "8", "--batch-size", "4", "--methods", "eva0",
                 "--out", str(out), "-q"]) == 0
    result = json.loads((out / "results.json").read_text())["results"]["eva0"]
    keys = [f"{d}@{p}" for p in range(1, 11) for d in ("black", "clean")]
    assert list(result["accuracy"]) == keys
    assert result["accuracy"]["black@1"] is None or np.isnan(result["accuracy"]["black@1"])
    assert result["final_stats"]["samples"] == 160


def test_the_hostile_summary_reads_every_stream_report(tmp_path, capsys):
    """``make hostile``'s table: one row per ``<model>-<stream>`` report, the clean gap EVA-0
    minus NoAdapt, unlabelled streams shown as '-'."""
    from eva0_edge.bench.hostile_summary import main

    def report(folder: str, stream: str, scores: dict[str, tuple[float, float]],
               seed: int = 0) -> None:
        results = {
            method: {"accuracy": {stream: on_stream, "clean": on_clean},
                     "final_stats": {"guard": {"trips": 1, "audits": 2}}}
            for method, (on_stream, on_clean) in scores.items()
        }
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps({
            "spec": {"model": "models/m.onnx", "limit": 500, "batch_size": 1, "seed": seed},
            "results": results}))

    report("m-gauss-0.3", "gauss-0.3", {"noadapt": (19.0, 91.4), "eva0": (44.4, 89.2)})
    report("m-gauss-0.3-seed1", "gauss-0.3", {"noadapt": (19.6, 91.4), "eva0": (44.0, 91.0)}, 1)
    report("m-black", "black", {"noadapt": (float("nan"), 91.4), "eva0": (float("nan"), 91.4)})
    assert main([str(tmp_path)]) == 0
    rows = {r["stream"]: r for r in json.loads((tmp_path / "hostile.json").read_text())}
    gauss = rows["gauss-0.3"]  # two seeds: gaps -2.2 and -0.4
    assert gauss["clean_gap"] == -1.3 and gauss["worst_gap"] == -2.2 and gauss["seeds"] == [0, 1]
    assert gauss["eva0_stream"] == 44.2 and gauss["trips"] == 2
    assert rows["black"]["noadapt_stream"] is None and rows["black"]["clean_gap"] == 0.0
    assert "| m | black | - | - | 91.4 | 91.4 | 0.0 | - | 0.0 | - | 1 | 1 | 2 |" \
        in capsys.readouterr().out


def test_the_hostile_summary_compares_the_methods_image_by_image(tmp_path):
    """With the runs' traces: the clean gap's standard error from the images only one method
    gets right, and where EVA-0's net losses fall (the first 50 clean images or later)."""
    from eva0_edge.bench.hostile_summary import summarise
    from eva0_edge.bench.testbed.protocols import StreamResult
    from eva0_edge.bench.testbed.report import traces_npz

    def trace(clean_hits: list[int]) -> StreamResult:
        hits = [0] * 10 + clean_hits  # 10 hostile images first
        domains = ["gauss-0.3"] * 10 + ["clean"] * len(clean_hits)
        return StreamResult("m", {}, 1, batch_correct=hits, batch_size=[1] * len(hits),
                            batch_domain=domains)

    noadapt = [1] * 100
    eva0 = [0, 0, 0] + [1] * 96 + [0]  # loses 3 early and 1 later
    eva0[70] = 0
    noadapt[80] = 0  # and wins one later: b = 5, c = 1
    for seed in (0, 1):
        folder = tmp_path / f"m-gauss-0.3-seed{seed}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({
            "spec": {"model": "models/m.onnx", "limit": 100, "batch_size": 1, "seed": seed},
            "results": {m: {"accuracy": {"gauss-0.3": 0.0, "clean": 100.0 * sum(h) / 100}}
                        for m, h in (("noadapt", noadapt), ("eva0", eva0))}}))
        (folder / "traces.npz").write_bytes(
            traces_npz({"noadapt": trace(noadapt), "eva0": trace(eva0)}))
    row = summarise(tmp_path)[0]
    assert row["clean_gap"] == -4.0
    assert row["gap_se"] == pytest.approx(round(100 * np.sqrt(6) / 100, 2) * np.sqrt(2) / 2,
                                          abs=0.01)
    assert (row["net_lost_early"], row["net_lost_later"]) == (6, 2)
